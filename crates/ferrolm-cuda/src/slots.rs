//! The expert slot cache of a GPU memory budget (`--gpu-memory` with
//! `FERROLM_CUDA_EXPERT_SLOTS=1`; docs/EXPERT_STREAMING.md): every expert stack stays in pinned
//! host memory, and what the budget leaves after the rest becomes a few device slots per
//! mixture-of-experts layer holding that layer's most chosen experts, re-chosen from the
//! selection counts as the model runs. In the decode step, `moe_stage` copies each chosen
//! expert's rows into a stage of `k` slots (from its device slot, or over the bus), through a
//! table of where each expert's rows are now; the products then read the stage at ids
//! `0 .. k - 1`. The bytes are the same wherever an expert lives, so the logits are too.
//! Prompt batches read the stacks in host memory as without the cache.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};

use crate::device::driver;
use crate::schedule::{Arg, Buf, DecodePlan, Launch};
use crate::CudaError;

/// Blocks of a `moe_stage` launch per chosen expert.
const STAGE_BLOCKS: u32 = 32;

/// The layers whose chosen experts the decode step stages, and the stages' sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedExperts {
    /// The layers, in order.
    pub layers: Vec<usize>,
    /// Bytes of the gate, up and down stages (`max_used` experts of the widest layer each).
    pub stage_bytes: [usize; 3],
}

impl DecodePlan {
    /// The plan with each of `layers`' chosen experts staged (`moe_stage` after the routing)
    /// and their products reading the stages ([`Buf::ExpertStage`], at [`Buf::SlotIds`]). A
    /// layer whose expert rows are not whole 16-byte words is left as it is (read in place).
    pub fn with_expert_slots(mut self, layers: &[usize]) -> Result<DecodePlan, CudaError> {
        let refuse = |what: String| Err(CudaError::Model(format!("the expert slots: {what}")));
        if self.staged_experts.is_some() || self.cpu_experts.is_some() {
            return refuse("stage before the CPU tier, once".into());
        }
        let mut staged = Vec::new();
        let mut stage_bytes = [0usize; 3];
        for &l in layers {
            let Some(moe) = self.layers.get(l).and_then(|r| r.moe.clone()) else {
                return refuse(format!("layer {l} has no experts"));
            };
            let bytes = moe
                .experts
                .map(|m| self.matrices[m].expert_bytes() as usize);
            if bytes.iter().any(|b| b % 16 != 0) {
                continue;
            }
            let (route, combine) = match self.moe_launches(l) {
                Ok(span) => span,
                Err(what) => return refuse(what),
            };
            for x in &mut self.launches[route + 1..combine] {
                let mut reads_stage = false;
                for a in &mut x.args {
                    if let Arg::Buf(Buf::Matrix(m)) = *a {
                        if let Some(i) = moe.experts.iter().position(|&e| e == m) {
                            *a = Arg::Buf(Buf::ExpertStage(i));
                            reads_stage = true;
                        }
                    }
                }
                // (a bias added by expert keeps the chosen ids)
                if reads_stage {
                    for a in &mut x.args {
                        if *a == Arg::Buf(Buf::ExpertIds) {
                            *a = Arg::Buf(Buf::SlotIds);
                        }
                    }
                }
            }
            let k = moe.n_used;
            self.launches.insert(
                route + 1,
                Launch {
                    kernel: "moe_stage".into(),
                    grid: (STAGE_BLOCKS, k as u32),
                    block: 256,
                    args: vec![
                        Arg::Buf(Buf::ExpertTable(l)),
                        Arg::I32(moe.n_expert as i32),
                        Arg::Buf(Buf::ExpertIds),
                        Arg::Buf(Buf::ExpertStage(0)),
                        Arg::Buf(Buf::ExpertStage(1)),
                        Arg::Buf(Buf::ExpertStage(2)),
                        Arg::I64(bytes[0] as i64),
                        Arg::I64(bytes[1] as i64),
                        Arg::I64(bytes[2] as i64),
                    ],
                    shared: 0,
                },
            );
            for (s, b) in stage_bytes.iter_mut().zip(bytes) {
                *s = (*s).max(k * b);
            }
            staged.push(l);
        }
        if !staged.is_empty() {
            self.staged_experts = Some(StagedExperts {
                layers: staged,
                stage_bytes,
            });
        }
        Ok(self)
    }
}

/// Which experts of each staged layer sit in its device slots, re-chosen from the selection
/// counts: an expert comes in when it was chosen more often, since the last choice (with half
/// the weight of the choice before, and so on), than the least chosen one it replaces, by a
/// margin (so that near ties do not swap rows back and forth).
#[derive(Clone, Debug)]
pub struct SlotCache {
    /// Slots per layer.
    pub per_layer: usize,
    layers: Vec<LayerSlots>,
    /// Selections served from a slot, and from host memory, up to the last choice.
    pub hits: u64,
    /// Selections served from host memory.
    pub misses: u64,
}

#[derive(Clone, Debug)]
struct LayerSlots {
    layer: usize,
    /// Slot -> expert.
    resident: Vec<u32>,
    /// The counts at the last choice.
    seen: Vec<u64>,
    /// Decayed selections since.
    score: Vec<f64>,
}

/// An expert brought into a slot (its rows copied there, the table pointed at them; the
/// expert it replaces pointed back at host memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMove {
    /// The layer.
    pub layer: usize,
    /// The slot.
    pub slot: usize,
    /// The expert coming in.
    pub expert: u32,
    /// The expert going out.
    pub evicted: u32,
}

/// How much more an expert must have been chosen than the one it replaces.
const MARGIN: f64 = 1.25;

impl SlotCache {
    /// `per_layer` slots for each of `layers` (mixtures of `n_expert[i]` experts each, at
    /// least `per_layer`), holding experts `0 .. per_layer` at first.
    pub fn new(layers: &[usize], n_expert: &[usize], per_layer: usize) -> SlotCache {
        SlotCache {
            per_layer,
            layers: layers
                .iter()
                .zip(n_expert)
                .map(|(&layer, &ne)| LayerSlots {
                    layer,
                    resident: (0..per_layer.min(ne) as u32).collect(),
                    seen: vec![0; ne],
                    score: vec![0.0; ne],
                })
                .collect(),
            hits: 0,
            misses: 0,
        }
    }

    /// Layer `l`'s expert in each slot.
    pub fn resident(&self, l: usize) -> Option<&[u32]> {
        self.layers
            .iter()
            .find(|s| s.layer == l)
            .map(|s| &s.resident[..])
    }

    /// The moves that bring each layer's most chosen experts into its slots, given the
    /// selection counts now (per model layer, per expert, cumulative); the hits and misses
    /// since the last call counted first.
    pub fn choose(&mut self, counts: &[Vec<u64>]) -> Vec<SlotMove> {
        let mut moves = Vec::new();
        for s in &mut self.layers {
            let Some(now) = counts.get(s.layer).filter(|c| c.len() == s.seen.len()) else {
                continue;
            };
            for (e, (&n, seen)) in now.iter().zip(&mut s.seen).enumerate() {
                let new = n.saturating_sub(*seen);
                *seen = n;
                if s.resident.contains(&(e as u32)) {
                    self.hits += new;
                } else {
                    self.misses += new;
                }
                s.score[e] = s.score[e] / 2.0 + new as f64;
            }
            if s.resident.is_empty() {
                continue;
            }
            // The best outsiders against the weakest residents, one pair at a time.
            let mut outside: Vec<u32> = (0..s.score.len() as u32)
                .filter(|e| !s.resident.contains(e))
                .collect();
            outside.sort_by(|&a, &b| {
                s.score[b as usize]
                    .total_cmp(&s.score[a as usize])
                    .then(a.cmp(&b))
            });
            for e in outside {
                let (slot, &weakest) = s
                    .resident
                    .iter()
                    .enumerate()
                    .min_by(|a, b| {
                        s.score[*a.1 as usize]
                            .total_cmp(&s.score[*b.1 as usize])
                            .then(a.1.cmp(b.1))
                    })
                    .expect("slots");
                if s.score[e as usize] <= MARGIN * s.score[weakest as usize] + 1.0 {
                    break;
                }
                s.resident[slot] = e;
                moves.push(SlotMove {
                    layer: s.layer,
                    slot,
                    expert: e,
                    evicted: weakest,
                });
            }
        }
        moves
    }
}

/// One staged layer's place in device memory and in host memory.
struct SlotLayer {
    layer: usize,
    n_expert: usize,
    /// The gate, up and down stacks' addresses (mapped host memory) and one expert's bytes
    /// of each.
    stacks: [u64; 3],
    bytes: [u64; 3],
    /// The layer's slots: `per_layer` experts' gate, up and down rows, one after another.
    memory: CudaSlice<u8>,
}

impl SlotLayer {
    fn per_expert(&self) -> u64 {
        self.bytes.iter().sum()
    }

    /// Where slot `slot`'s rows of matrix `m` are.
    fn slot_address(&self, stream: &CudaStream, slot: usize, m: usize) -> u64 {
        let base = self.memory.device_ptr(stream).0;
        base + slot as u64 * self.per_expert() + self.bytes[..m].iter().sum::<u64>()
    }
}

/// The slot cache on the device: each staged layer's slots, and the policy choosing what
/// they hold.
pub(crate) struct DeviceSlots {
    cache: SlotCache,
    layers: Vec<SlotLayer>,
    /// Decode steps between choices, and steps since the last.
    interval: usize,
    since: usize,
}

/// Bytes of the slots of `per_layer` experts in each of `staged`'s layers.
pub(crate) fn slot_bytes(p: &DecodePlan, staged: &StagedExperts, per_layer: usize) -> u64 {
    staged
        .layers
        .iter()
        .filter_map(|&l| p.layers[l].moe.as_ref())
        .map(|m| {
            let one: u64 = m
                .experts
                .iter()
                .map(|&x| p.matrices[x].expert_bytes())
                .sum();
            per_layer.min(m.n_expert) as u64 * one
        })
        .sum()
}

impl DeviceSlots {
    /// `per_layer` slots for each staged layer of `p` (whose stacks are at `matrix_addrs`, in
    /// mapped host memory), filled with experts `0 .. per_layer`, chosen again every
    /// `interval` decode steps.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        p: &DecodePlan,
        matrix_addrs: &[u64],
        per_layer: usize,
        interval: usize,
    ) -> Result<DeviceSlots, CudaError> {
        let staged = p.staged_experts.as_ref().map_or(&[][..], |s| &s.layers[..]);
        let mut layers = Vec::with_capacity(staged.len());
        let mut n_expert = Vec::with_capacity(staged.len());
        for &l in staged {
            let m = p.layers[l]
                .moe
                .as_ref()
                .expect("staged layers have experts");
            let bytes = m.experts.map(|x| p.matrices[x].expert_bytes());
            let slots = per_layer.min(m.n_expert);
            let memory = stream
                .alloc_zeros::<u8>((slots as u64 * bytes.iter().sum::<u64>()).max(16) as usize)
                .map_err(driver("the expert slots"))?;
            layers.push(SlotLayer {
                layer: l,
                n_expert: m.n_expert,
                stacks: m.experts.map(|x| matrix_addrs[x]),
                bytes,
                memory,
            });
            n_expert.push(m.n_expert);
        }
        let slots = DeviceSlots {
            cache: SlotCache::new(staged, &n_expert, per_layer),
            layers,
            interval: interval.max(1),
            since: 0,
        };
        for (i, sl) in slots.layers.iter().enumerate() {
            let resident = slots.cache.resident(sl.layer).expect("a staged layer");
            for (slot, &e) in resident.iter().enumerate() {
                slots.fill(stream, i, slot, e)?;
            }
        }
        Ok(slots)
    }

    /// Copies expert `e`'s rows of staged layer `i` into slot `slot` (in stream order).
    fn fill(&self, stream: &CudaStream, i: usize, slot: usize, e: u32) -> Result<(), CudaError> {
        let sl = &self.layers[i];
        for m in 0..3 {
            let src = sl.stacks[m] + u64::from(e) * sl.bytes[m];
            let dst = sl.slot_address(stream, slot, m);
            // SAFETY: both ranges lie in memory this model holds (the slots, the mapped
            // stack); the copy is ordered on the model's stream like every kernel.
            unsafe { sys::cuMemcpyAsync(dst, src, sl.bytes[m] as usize, stream.cu_stream()) }
                .result()
                .map_err(driver("filling an expert slot"))?;
        }
        Ok(())
    }

    /// Each staged layer's table ([`Buf::ExpertTable`]) as it should be now: the gate, up and
    /// down rows' address of every expert, in its slot or in host memory.
    pub(crate) fn tables(&self, stream: &CudaStream) -> Vec<(Buf, Vec<u8>)> {
        self.layers
            .iter()
            .map(|sl| {
                let resident = self.cache.resident(sl.layer).expect("a staged layer");
                let mut t = Vec::with_capacity(8 * 3 * sl.n_expert);
                for m in 0..3 {
                    for e in 0..sl.n_expert as u32 {
                        let at = match resident.iter().position(|&r| r == e) {
                            Some(slot) => sl.slot_address(stream, slot, m),
                            None => sl.stacks[m] + u64::from(e) * sl.bytes[m],
                        };
                        t.extend_from_slice(&at.to_le_bytes());
                    }
                }
                (Buf::ExpertTable(sl.layer), t)
            })
            .collect()
    }

    /// Called before each decode step: every `interval` steps, the counts read (`counts`
    /// gives them: a sync) and the most chosen experts copied into the slots; whether the
    /// tables changed (the caller writes [`DeviceSlots::tables`] then).
    pub(crate) fn step(
        &mut self,
        stream: &CudaStream,
        counts: impl FnOnce() -> Result<Vec<Vec<u64>>, CudaError>,
    ) -> Result<bool, CudaError> {
        self.since += 1;
        if self.since < self.interval {
            return Ok(false);
        }
        self.since = 0;
        let moves = self.cache.choose(&counts()?);
        for mv in &moves {
            let i = (self.layers.iter())
                .position(|sl| sl.layer == mv.layer)
                .expect("a staged layer");
            self.fill(stream, i, mv.slot, mv.expert)?;
        }
        Ok(!moves.is_empty())
    }

    /// Selections served from a slot and from host memory (up to the last choice), the
    /// slots' bytes, and the bytes of the rows a miss reads over the bus (the widest layer's
    /// expert).
    pub(crate) fn usage(&self) -> (u64, u64, u64, u64) {
        let slot_bytes = self.layers.iter().map(|sl| sl.memory.len() as u64).sum();
        let one = self
            .layers
            .iter()
            .map(SlotLayer::per_expert)
            .max()
            .unwrap_or(0);
        (self.cache.hits, self.cache.misses, slot_bytes, one)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(layer_counts: &[(usize, Vec<u64>)], n_layers: usize) -> Vec<Vec<u64>> {
        let mut c = vec![Vec::new(); n_layers];
        for (l, v) in layer_counts {
            c[*l] = v.clone();
        }
        c
    }

    #[test]
    fn the_most_chosen_experts_come_into_the_slots_and_near_ties_stay_put() {
        let mut cache = SlotCache::new(&[1, 3], &[6, 6], 2);
        assert_eq!(cache.resident(1), Some(&[0, 1][..]));
        // Layer 1: experts 4 and 5 chosen far more than 0 and 1; layer 3: a near tie.
        let c = counts(
            &[
                (1, vec![1, 2, 0, 0, 40, 30]),
                (3, vec![10, 10, 12, 0, 0, 0]),
            ],
            4,
        );
        let moves = cache.choose(&c);
        assert_eq!(cache.resident(1), Some(&[4, 5][..]), "{moves:?}");
        assert_eq!(cache.resident(3), Some(&[0, 1][..]), "{moves:?}");
        assert_eq!(moves.len(), 2);
        assert!(moves.iter().all(|m| m.layer == 1));
        assert!(moves.contains(&SlotMove {
            layer: 1,
            slot: 0,
            expert: 4,
            evicted: 0
        }));
        // Hits and misses count the selections before the choice: layer 1's 3 of 73 and
        // layer 3's 20 of 32 were in slots.
        assert_eq!((cache.hits, cache.misses), (23, 82));
        // Nothing chosen since: nothing moves, and an old favourite's score halves each time.
        assert!(cache.choose(&c).is_empty());
        let later = counts(
            &[
                (1, vec![1, 2, 0, 0, 40, 30]),
                (3, vec![10, 10, 60, 0, 0, 0]),
            ],
            4,
        );
        let moves = cache.choose(&later);
        assert_eq!(moves.len(), 1);
        assert_eq!(moves[0].expert, 2);
        assert_eq!(
            cache
                .resident(3)
                .unwrap()
                .iter()
                .filter(|&&e| e == 2)
                .count(),
            1
        );
    }

    #[test]
    fn a_layer_of_fewer_experts_than_slots_holds_them_all() {
        let mut cache = SlotCache::new(&[0], &[3], 8);
        assert_eq!(cache.resident(0), Some(&[0, 1, 2][..]));
        assert!(cache.choose(&[vec![5, 5, 5]]).is_empty());
        assert_eq!((cache.hits, cache.misses), (15, 0));
    }
}
