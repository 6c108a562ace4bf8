//! Where each matrix lives under a GPU memory budget (`--gpu-memory`): everything but the
//! stacked expert tensors must be on the device (weights, caches, batch buffers); the experts
//! fill what the budget leaves, layer by layer, and the rest stay in pinned host memory that
//! the kernels read over the bus (mapped into the device's address space, so the products
//! and the step's graph are the same wherever a stack lives).
//!
//! The unit is a whole stacked tensor (one layer's gate, up or down experts): a first tier. A
//! cache of hot experts in device slots, following the selection counts, is what comes next
//! (docs/EXPERT_STREAMING.md).

use crate::schedule::DecodePlan;
use crate::CudaError;

/// Where a matrix lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// Device memory.
    Device,
    /// Pinned host memory, mapped for the device.
    Host,
}

/// Each matrix's tier under `budget` bytes of device memory, where `fixed` bytes (the caches,
/// the batch buffers, the step's buffers) must also fit: the matrices that are not expert
/// stacks first, then the expert stacks in order while they fit. `None`: no budget, all on
/// the device. Errors when what must be on the device does not fit, saying how many bytes it
/// needs and how many the budget leaves.
pub fn place(p: &DecodePlan, fixed: u64, budget: Option<u64>) -> Result<Vec<Tier>, CudaError> {
    let bytes = |m: usize| p.matrices[m].total_bytes();
    let is_stack = |m: usize| p.matrices[m].experts > 1;
    let Some(budget) = budget else {
        return Ok(vec![Tier::Device; p.matrices.len()]);
    };
    let mut left = room_for_experts(p, fixed, budget)?;
    Ok((0..p.matrices.len())
        .map(|m| {
            if !is_stack(m) {
                return Tier::Device;
            }
            if bytes(m) <= left {
                left -= bytes(m);
                Tier::Device
            } else {
                Tier::Host
            }
        })
        .collect())
}

/// Bytes `budget` leaves for expert stacks once every other matrix and `fixed` bytes fit;
/// errors when they do not, saying how many bytes they need and how many the budget leaves.
pub fn room_for_experts(p: &DecodePlan, fixed: u64, budget: u64) -> Result<u64, CudaError> {
    let dense: u64 = (p.matrices.iter())
        .filter(|m| m.experts <= 1)
        .map(|m| m.total_bytes())
        .sum();
    let needed = dense + fixed;
    if needed > budget {
        return Err(CudaError::Model(format!(
            "a GPU memory budget of {budget} bytes cannot hold what must stay on the GPU: \
             {needed} bytes ({dense} of weights besides the experts, {fixed} of caches and \
             buffers); {} more are needed",
            needed - budget
        )));
    }
    Ok(budget - needed)
}

/// Every expert stack in host memory, the rest on the device (the slot cache's placement,
/// `slots.rs`).
pub fn stacks_on_host(p: &DecodePlan) -> Vec<Tier> {
    (p.matrices.iter())
        .map(|m| {
            if m.experts > 1 {
                Tier::Host
            } else {
                Tier::Device
            }
        })
        .collect()
}

/// `tiers` with every layer's expert stacks in one tier: a layer with any stack in host
/// memory has all of them there (experts streamed from the file, whose CPU tier computes a
/// layer's chosen experts whole).
pub fn whole_layers(p: &DecodePlan, mut tiers: Vec<Tier>) -> Vec<Tier> {
    for r in &p.layers {
        if let Some(m) = &r.moe {
            if m.experts.iter().any(|&s| tiers[s] == Tier::Host) {
                m.experts.iter().for_each(|&s| tiers[s] = Tier::Host);
            }
        }
    }
    tiers
}

/// The mixture-of-experts layers whose gate, up and down stacks all stay in host memory:
/// those whose chosen experts the CPU tier may share ([`crate::cpu_tier`]).
pub fn host_layers(p: &DecodePlan, tiers: &[Tier]) -> Vec<usize> {
    (0..p.layers.len())
        .filter(|&l| {
            p.layers[l]
                .moe
                .as_ref()
                .is_some_and(|m| m.experts.iter().all(|&s| tiers[s] == Tier::Host))
        })
        .collect()
}

/// What the tiers served, from the selection counts (per layer, per expert; empty per dense
/// layer): the selections whose gate, up and down rows are all in device memory, the others,
/// and the bytes of the others' host-memory rows (each selection's: a decode step reads a
/// chosen expert's rows once per token; a prompt batch reads them once for all its tokens, so
/// it moves less than this over the bus).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierTraffic {
    /// Selections served from device memory alone.
    pub device: u64,
    /// Selections that read rows in host memory.
    pub host: u64,
    /// Bytes of those rows.
    pub host_bytes: u64,
}

/// [`TierTraffic`] of `counts` under `tiers`.
pub fn traffic(p: &DecodePlan, tiers: &[Tier], counts: &[Vec<u64>]) -> TierTraffic {
    let mut t = TierTraffic::default();
    for (layer, counts) in p.layers.iter().zip(counts) {
        let Some(moe) = &layer.moe else { continue };
        // (one expert's rows of each stack that lives on the host)
        let host_bytes: u64 = moe
            .experts
            .iter()
            .filter(|&&m| tiers[m] == Tier::Host)
            .map(|&m| p.matrices[m].expert_bytes())
            .sum();
        let selections: u64 = counts.iter().sum();
        if host_bytes == 0 {
            t.device += selections;
        } else {
            t.host += selections;
            t.host_bytes += selections * host_bytes;
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::tests::{all, plan};
    use crate::schedule::{decode_plan, MatrixSpec};
    use ferrolm_gguf::TensorType;

    /// A plan of two layers whose last three matrices are turned into expert stacks.
    fn with_stacks() -> DecodePlan {
        let pl = plan(2, 32);
        let mut dp = decode_plan(&pl, &all(&pl, TensorType::Q8_0), 64).unwrap();
        let n = dp.matrices.len();
        for m in &mut dp.matrices[n - 4..n - 1] {
            *m = MatrixSpec {
                experts: 4,
                rows: 4 * m.rows,
                ..m.clone()
            };
        }
        dp
    }

    fn bytes(dp: &DecodePlan, m: usize) -> u64 {
        dp.matrices[m].total_bytes()
    }

    #[test]
    fn the_experts_fill_what_the_budget_leaves_and_the_rest_stay_on_the_host() {
        let dp = with_stacks();
        let n = dp.matrices.len();
        let all: u64 = (0..n).map(|m| bytes(&dp, m)).sum();
        let stacks: Vec<usize> = (0..n).filter(|&m| dp.matrices[m].experts > 1).collect();
        assert_eq!(stacks.len(), 3);
        // No budget, or room for everything: all on the device.
        assert!(place(&dp, 1000, None)
            .unwrap()
            .iter()
            .all(|&t| t == Tier::Device));
        let roomy = place(&dp, 1000, Some(all + 1000)).unwrap();
        assert!(roomy.iter().all(|&t| t == Tier::Device));
        // Room for the dense part and one stack: that stack on the device, the others not.
        let dense = all - stacks.iter().map(|&m| bytes(&dp, m)).sum::<u64>();
        let one = place(&dp, 1000, Some(dense + 1000 + bytes(&dp, stacks[0]))).unwrap();
        let on_device: Vec<usize> = stacks
            .iter()
            .copied()
            .filter(|&m| one[m] == Tier::Device)
            .collect();
        assert_eq!(on_device, [stacks[0]]);
        assert!((0..n)
            .filter(|m| !stacks.contains(m))
            .all(|m| one[m] == Tier::Device));
        // What the device holds stays within the budget.
        let held: u64 = (0..n)
            .filter(|&m| one[m] == Tier::Device)
            .map(|m| bytes(&dp, m))
            .sum();
        assert!(held + 1000 <= dense + 1000 + bytes(&dp, stacks[0]));
    }

    #[test]
    fn traffic_counts_each_selection_where_its_rows_live() {
        let pl = crate::schedule::tests::moe_plan();
        let dp = decode_plan(&pl, &all(&pl, TensorType::Q8_0), 64).unwrap();
        let moe_layers: Vec<usize> = (0..dp.layers.len())
            .filter(|&l| dp.layers[l].moe.is_some())
            .collect();
        assert!(!moe_layers.is_empty());
        let counts: Vec<Vec<u64>> = dp
            .layers
            .iter()
            .enumerate()
            .map(|(l, r)| {
                let n = r.moe.as_ref().map_or(0, |m| m.n_expert);
                (0..n as u64).map(|e| e + l as u64).collect()
            })
            .collect();
        let total: u64 = counts.iter().flatten().sum();
        let on_device = vec![Tier::Device; dp.matrices.len()];
        assert_eq!(
            traffic(&dp, &on_device, &counts),
            TierTraffic {
                device: total,
                host: 0,
                host_bytes: 0
            }
        );
        // The first MoE layer's up stack on the host: that layer's selections read it.
        let l = moe_layers[0];
        let up = dp.layers[l].moe.as_ref().unwrap().experts[1];
        let mut tiers = on_device.clone();
        tiers[up] = Tier::Host;
        let one = dp.matrices[up].expert_bytes();
        let layer: u64 = counts[l].iter().sum();
        assert_eq!(
            traffic(&dp, &tiers, &counts),
            TierTraffic {
                device: total - layer,
                host: layer,
                host_bytes: layer * one
            }
        );
    }

    #[test]
    fn a_budget_too_small_for_the_dense_part_says_how_much_is_needed() {
        let dp = with_stacks();
        let e = place(&dp, 5000, Some(4000)).unwrap_err().to_string();
        assert!(e.contains("budget of 4000 bytes"), "{e}");
        assert!(e.contains("5000 of caches and buffers"), "{e}");
        assert!(e.contains("more are needed"), "{e}");
    }

    #[test]
    fn a_layer_with_a_stack_on_the_host_goes_there_whole() {
        let pl = crate::schedule::tests::moe_plan();
        let dp = decode_plan(&pl, &all(&pl, TensorType::Q8_0), 64).unwrap();
        let moe: Vec<[usize; 3]> = (dp.layers.iter())
            .filter_map(|r| r.moe.as_ref().map(|m| m.experts))
            .collect();
        assert!(!moe.is_empty());
        let mut tiers = vec![Tier::Device; dp.matrices.len()];
        assert_eq!(whole_layers(&dp, tiers.clone()), tiers);
        tiers[moe[0][2]] = Tier::Host;
        let whole = whole_layers(&dp, tiers.clone());
        assert!(moe[0].iter().all(|&s| whole[s] == Tier::Host));
        // (nothing else moves)
        let moved = (0..tiers.len()).filter(|&m| tiers[m] != whole[m]).count();
        assert_eq!(moved, 2);
        assert_eq!(host_layers(&dp, &whole).len(), 1);
    }
}
