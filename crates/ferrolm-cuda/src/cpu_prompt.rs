//! The CPU tier in prompt batches (docs/EXPERT_STREAMING.md): in a layer whose expert stacks
//! stay in host memory, the CPU computes the groups of the layer's last experts (by id) for
//! every token of the batch that chose them, while the GPU multiplies the other groups with
//! rows it reads over the bus; each side reads its experts' rows once for the whole batch.
//! The GPU's products and the CPU's are queued and computed at once; the CPU's rows are then
//! copied into the grouped outputs, where the weighted sum takes them in slot order as it
//! takes the GPU's.
//!
//! How many experts the CPU takes is either fixed or adapted layer after layer: when the CPU
//! finishes its groups before the GPU has finished its own it takes one more expert at the
//! next layer, otherwise one fewer, so that both sides finish together.

use std::ops::Range;

use ferrolm_model::HostExperts;
use ferrolm_threads::ThreadPool;

use crate::CudaError;

/// The CPU's part of the prompt batches' expert groups, and the host copies it works from.
pub struct PromptCpuShare {
    experts: HostExperts,
    pool: ThreadPool,
    /// Per layer of the plan: whether the CPU takes part there.
    layers: Vec<bool>,
    /// Experts a layer the CPU takes (the last ids).
    count: usize,
    /// Whether `count` follows which side finishes first.
    adapt: bool,
    /// Rows (token, expert pairs) computed on the CPU and on the GPU in those layers so far.
    cpu_rows: u64,
    gpu_rows: u64,
    /// The batch's chosen ids and each pair's grouped row, as the device made them, and the
    /// f32 normed inputs; the CPU's groups' inputs and outputs.
    pub(crate) ids: Vec<u32>,
    pub(crate) at: Vec<u32>,
    pub(crate) normed: Vec<f32>,
    x: Vec<f32>,
    y: Box<dyn RowsMemory>,
    /// Values of `y` the last [`PromptCpuShare::compute`] wrote.
    y_len: usize,
}

/// Where the CPU writes its output rows for their copy to the device: a `Vec`, or page-locked
/// memory (the CUDA backend's), whose copy runs at the bus's speed without a staging copy.
/// Such a copy may still read the memory after the call that queued it returns; the prompt
/// pass waits for the device (reading the next layer's counts) before the CPU writes again.
pub trait RowsMemory: Send {
    /// Room for at least `len` values (an error where it has less), for writing.
    fn rows_mut(&mut self, len: usize) -> Result<&mut [f32], String>;
    /// The first `len` values.
    fn rows(&self, len: usize) -> Result<&[f32], String>;
}

impl RowsMemory for Vec<f32> {
    fn rows_mut(&mut self, len: usize) -> Result<&mut [f32], String> {
        if self.len() < len {
            self.resize(len, 0.0);
        }
        Ok(&mut self[..len])
    }

    fn rows(&self, len: usize) -> Result<&[f32], String> {
        self.get(..len)
            .ok_or_else(|| format!("{len} output values past the {}", self.len()))
    }
}

/// Where a layer's batch splits between the GPU and the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// The first expert the CPU computes: experts `first..` are the CPU's.
    pub first: usize,
    /// The first grouped row of the CPU's groups: rows `row..` are theirs (the groups lie in
    /// expert order, each expert's rows together).
    pub row: usize,
}

impl PromptCpuShare {
    /// The share over `experts` (holding each of `layers`) on `threads` threads, for a plan of
    /// `n_layers` layers: `count` experts a layer, or adapted from there when `adapt`.
    pub fn new(
        experts: HostExperts,
        layers: &[usize],
        n_layers: usize,
        threads: usize,
        count: usize,
        adapt: bool,
    ) -> Result<PromptCpuShare, CudaError> {
        if let Some(&l) = layers.iter().find(|&&l| !experts.has_layer(l)) {
            return Err(CudaError::Model(format!(
                "the CPU tier in prompts: layer {l}'s experts are not on the host"
            )));
        }
        let pool = ThreadPool::new(threads.max(1))
            .map_err(|e| CudaError::Model(format!("the CPU tier's prompt threads: {e}")))?;
        let mut on = vec![false; n_layers];
        for &l in layers {
            if let Some(x) = on.get_mut(l) {
                *x = true;
            }
        }
        Ok(PromptCpuShare {
            experts,
            pool,
            layers: on,
            count: count.max(1),
            adapt,
            cpu_rows: 0,
            gpu_rows: 0,
            ids: Vec::new(),
            at: Vec::new(),
            normed: Vec::new(),
            x: Vec::new(),
            y: Box::new(Vec::new()),
            y_len: 0,
        })
    }

    /// Whether the CPU takes part in layer `l`.
    pub fn serves(&self, l: usize) -> bool {
        self.layers.get(l).copied().unwrap_or(false)
    }

    /// Experts the CPU takes in a layer of `ne`: adapted counts leave each side at least one.
    pub fn count(&self, ne: usize) -> usize {
        if self.adapt {
            self.count.clamp(1, ne.saturating_sub(1).max(1))
        } else {
            self.count.min(ne)
        }
    }

    /// Rows computed on the CPU and on the GPU in the shared layers so far.
    pub fn rows(&self) -> (u64, u64) {
        (self.cpu_rows, self.gpu_rows)
    }

    /// Where a layer of `ne` experts splits, given each expert's rows in the batch (`used`).
    pub fn split(&self, used: &[u32]) -> Split {
        let first = used.len() - self.count(used.len());
        let row = used[..first].iter().map(|&c| c as usize).sum();
        Split { first, row }
    }

    /// The outputs of the CPU's rows of the last [`PromptCpuShare::compute`].
    pub fn output(&self) -> Result<&[f32], CudaError> {
        (self.y.rows(self.y_len))
            .map_err(|e| CudaError::Model(format!("the CPU tier in prompts: {e}")))
    }

    /// Writes the CPU's output rows into `memory` from now on.
    pub fn set_rows_memory(&mut self, memory: Box<dyn RowsMemory>) {
        self.y = memory;
        self.y_len = 0;
    }

    /// Sizes the host copies for a batch of `n` tokens of `k` pairs each, `d` wide.
    pub(crate) fn prepare(&mut self, n: usize, k: usize, d: usize) {
        self.ids.resize(n * k, 0);
        self.at.resize(n * k, 0);
        self.normed.resize(n * d, 0.0);
    }

    /// The CPU's groups of layer `l` (`k` pairs a token; ids, rows and inputs as
    /// [`PromptCpuShare::prepare`] sized them, filled from the device): each pair whose
    /// expert is `split.first` or later gets its token's input at its grouped row, and each
    /// such expert's rows are computed: the outputs of rows `split.row..` (the rest of the
    /// batch's pairs) in [`PromptCpuShare::output`].
    pub fn compute(&mut self, l: usize, k: usize, split: Split) -> Result<(), CudaError> {
        let d = self.experts.d();
        let pairs = self.ids.len();
        let rows = pairs.saturating_sub(split.row);
        self.x.resize(rows * d, 0.0);
        self.y_len = 0;
        if rows == 0 {
            self.gpu_rows += split.row as u64;
            return Ok(());
        }
        // Each CPU expert's span of rows, and which rows were filled.
        let mut spans: Vec<Option<Range<usize>>> = Vec::new();
        let mut filled = vec![false; rows];
        for (i, (&e, &at)) in self.ids.iter().zip(&self.at).enumerate() {
            let (e, at) = (e as usize, at as usize);
            if e < split.first {
                continue;
            }
            let r = at
                .checked_sub(split.row)
                .filter(|&r| r < rows && !filled[r]);
            let Some(r) = r else {
                return Err(CudaError::Model(format!(
                    "the CPU tier in prompts: layer {l}'s pair {i} (expert {e}) at row {at}, \
                     not a free row of the CPU's {}..{pairs}",
                    split.row
                )));
            };
            filled[r] = true;
            let t = i / k;
            self.x[r * d..(r + 1) * d].copy_from_slice(&self.normed[t * d..(t + 1) * d]);
            let j = e - split.first;
            if spans.len() <= j {
                spans.resize(j + 1, None);
            }
            let span = spans[j].get_or_insert(r..r + 1);
            span.start = span.start.min(r);
            span.end = span.end.max(r + 1);
        }
        // Every CPU row filled, and the experts' spans tile them in expert order (the device's
        // grouping).
        let groups: Vec<(u32, Range<usize>)> = (spans.into_iter().enumerate())
            .filter_map(|(j, s)| s.map(|s| ((split.first + j) as u32, s)))
            .collect();
        let tiled = filled.iter().all(|&f| f)
            && groups.first().is_some_and(|(_, s)| s.start == 0)
            && groups.windows(2).all(|w| w[0].1.end == w[1].1.start);
        if !tiled {
            return Err(CudaError::Model(format!(
                "the CPU tier in prompts: layer {l}'s groups do not tile rows {}..{pairs}",
                split.row
            )));
        }
        let y = (self.y.rows_mut(rows * d))
            .map_err(|e| CudaError::Model(format!("the CPU tier in prompts: {e}")))?;
        self.experts
            .grouped(&self.pool, l, &groups, &self.x, y)
            .map_err(|e| CudaError::Model(e.to_string()))?;
        self.y_len = rows * d;
        self.cpu_rows += rows as u64;
        self.gpu_rows += split.row as u64;
        Ok(())
    }

    /// After a layer: the GPU had finished its groups by the time the CPU finished
    /// (`gpu_idle`): the CPU takes one fewer expert next time, else one more.
    pub fn adapt(&mut self, gpu_idle: bool, ne: usize) {
        if self.adapt {
            let c = self.count(ne);
            self.count = if gpu_idle { c - 1 } else { c + 1 }.clamp(1, ne.max(2) - 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_model::synthetic::{self, SyntheticSpec};
    use ferrolm_model::Model;

    fn share(count: usize, adapt: bool) -> PromptCpuShare {
        let mut spec = SyntheticSpec::small("qwen3moe");
        spec.n_expert = 8;
        let file = std::sync::Arc::new(
            ferrolm_gguf::GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes())
                .unwrap(),
        );
        let model = Model::from_file(file, 1).unwrap();
        let experts = model.host_experts(&[1]).unwrap();
        PromptCpuShare::new(experts, &[1], spec.n_layer, 1, count, adapt).unwrap()
    }

    #[test]
    fn the_split_gives_the_cpu_the_last_experts_rows() {
        let s = share(3, false);
        assert!(s.serves(1) && !s.serves(0) && !s.serves(9));
        assert_eq!(
            s.split(&[2, 0, 1, 4, 3, 0, 1, 5]),
            Split { first: 5, row: 10 }
        );
        // A fixed count may take every expert; an adapted one leaves the GPU one.
        assert_eq!(share(9, false).split(&[1, 1]), Split { first: 0, row: 0 });
        assert_eq!(share(9, true).split(&[1, 1]), Split { first: 1, row: 1 });
    }

    #[test]
    fn the_count_follows_the_side_that_finishes_first() {
        let mut s = share(3, true);
        s.adapt(false, 8);
        s.adapt(false, 8);
        assert_eq!(s.count(8), 5);
        for _ in 0..10 {
            s.adapt(true, 8);
        }
        assert_eq!(s.count(8), 1);
        for _ in 0..10 {
            s.adapt(false, 8);
        }
        assert_eq!(s.count(8), 7);
        let mut fixed = share(3, false);
        fixed.adapt(true, 8);
        assert_eq!(fixed.count(8), 3);
    }

    #[test]
    fn rows_the_device_did_not_group_are_refused() {
        let mut s = share(1, false);
        // Two tokens of two pairs; expert 7 (the CPU's) chosen by pairs 1 and 2.
        s.prepare(2, 2, s.experts.d());
        s.ids.copy_from_slice(&[0, 7, 7, 3]);
        let split = Split { first: 7, row: 2 };
        // Pair 1 at row 2 and pair 2 at row 5: past the 4 rows.
        s.at.copy_from_slice(&[0, 2, 5, 1]);
        let e = s.compute(1, 2, split).unwrap_err().to_string();
        assert!(e.contains("row 5"), "{e}");
        // Both at row 2.
        s.at.copy_from_slice(&[0, 2, 2, 1]);
        let e = s.compute(1, 2, split).unwrap_err().to_string();
        assert!(e.contains("pair 2") && e.contains("row 2"), "{e}");
        s.at.copy_from_slice(&[0, 2, 3, 1]);
        s.compute(1, 2, split).unwrap();
        assert_eq!(s.output().unwrap().len(), 2 * s.experts.d());
        assert_eq!(s.rows(), (2, 2));
    }

    /// Output memory of a fixed room (as the pinned memory is): a batch past it is an error,
    /// not a write past its end; within it the rows land there.
    #[test]
    fn output_memory_of_too_little_room_is_an_error() {
        struct Fixed(Vec<f32>);
        impl RowsMemory for Fixed {
            fn rows_mut(&mut self, len: usize) -> Result<&mut [f32], String> {
                let room = self.0.len();
                (self.0.get_mut(..len)).ok_or_else(|| format!("{len} values past the {room}"))
            }
            fn rows(&self, len: usize) -> Result<&[f32], String> {
                self.0.get(..len).ok_or_else(|| "past".into())
            }
        }
        let mut s = share(1, false);
        let d = s.experts.d();
        s.prepare(2, 2, d);
        s.ids.copy_from_slice(&[0, 7, 7, 3]);
        s.at.copy_from_slice(&[0, 2, 3, 1]);
        s.normed
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 5) as f32 - 2.0);
        let split = Split { first: 7, row: 2 };
        s.set_rows_memory(Box::new(Fixed(vec![0.0; d])));
        let e = s.compute(1, 2, split).unwrap_err().to_string();
        assert!(e.contains(&format!("{} values past the {d}", 2 * d)), "{e}");
        s.set_rows_memory(Box::new(Fixed(vec![0.0; 3 * d])));
        s.compute(1, 2, split).unwrap();
        let got = s.output().unwrap().to_vec();
        s.set_rows_memory(Box::new(Vec::new()));
        s.compute(1, 2, split).unwrap();
        assert_eq!(got, s.output().unwrap());
        assert!(got.iter().any(|&v| v != 0.0));
    }
}
