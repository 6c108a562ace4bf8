//! The CPU tier in prompt batches (docs/EXPERT_STREAMING.md): in a layer whose expert stacks
//! stay in host memory, the CPU computes the groups of the layer's last experts (by id) for
//! every token of the batch that chose them, while the GPU multiplies the other groups with
//! rows it reads over the bus; each side reads its experts' rows once for the whole batch.
//! The GPU's products and the CPU's are queued and computed at once; the CPU's rows are then
//! copied into the grouped outputs, where the weighted sum takes them in slot order as it
//! takes the GPU's.
//!
//! How many experts the CPU takes is either fixed or adapted layer after layer: when the CPU
//! finishes its groups before the GPU has finished its own it takes more at the next layer,
//! otherwise fewer (bisecting between the latest counts seen on either side), so that both
//! sides finish together.

use std::ops::Range;

use ferrolm_model::HostExperts;
use ferrolm_threads::ThreadPool;

use crate::CudaError;

/// The CPU's part of the prompt batches' expert groups, and the host copies it works from.
pub struct PromptCpuShare {
    /// The experts of the layers the CPU takes part in.
    experts: HostExperts,
    pool: ThreadPool,
    /// Experts a layer the CPU takes (the last ids).
    count: usize,
    /// Whether `count` follows which side finishes first; the latest counts seen to leave
    /// the CPU the faster side and the slower one (a bracket to halve); the next move while
    /// only one side of it is known (doubling).
    adapt: bool,
    faster: Option<usize>,
    slower: Option<usize>,
    step: usize,
    /// Rows (token, expert pairs) computed on the CPU and on the GPU in those layers so far.
    cpu_rows: u64,
    gpu_rows: u64,
    /// The batch's chosen ids and each pair's grouped row, as the device made them, and the
    /// f32 normed inputs; the CPU's groups' inputs and outputs.
    pub(crate) ids: Vec<u32>,
    pub(crate) at: Vec<u32>,
    pub(crate) normed: Vec<f32>,
    /// The layer's rows an expert ([`PromptCpuShare::split`]), each expert's first row in the
    /// compact groups (where `at` counts from), and the rows of each padded group in the
    /// grouped outputs (`None`: not padded, the compact places).
    used: Vec<usize>,
    compact: Vec<usize>,
    most: Option<usize>,
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
    /// The first row of the CPU's groups in the grouped outputs: rows `row..row + rows` are
    /// theirs (the groups lie in expert order, each expert's rows together, padded to the
    /// same count where the device pads them).
    pub row: usize,
    /// How many (padding rows included).
    pub rows: usize,
}

impl PromptCpuShare {
    /// The share over `experts` (the layers it takes part in) on `threads` threads: `count`
    /// experts a layer, or adapted from there when `adapt`.
    pub fn new(
        experts: HostExperts,
        threads: usize,
        count: usize,
        adapt: bool,
    ) -> Result<PromptCpuShare, CudaError> {
        let pool = ThreadPool::new(threads.max(1))
            .map_err(|e| CudaError::Model(format!("the CPU tier's prompt threads: {e}")))?;
        Ok(PromptCpuShare {
            experts,
            pool,
            count: count.max(1),
            adapt,
            faster: None,
            slower: None,
            step: 1,
            cpu_rows: 0,
            gpu_rows: 0,
            ids: Vec::new(),
            at: Vec::new(),
            normed: Vec::new(),
            used: Vec::new(),
            compact: Vec::new(),
            most: None,
            x: Vec::new(),
            y: Box::new(Vec::new()),
            y_len: 0,
        })
    }

    /// Whether the CPU takes part in layer `l`.
    pub fn serves(&self, l: usize) -> bool {
        self.experts.has_layer(l)
    }

    /// Expert `e`'s first row in the grouped outputs.
    fn start(&self, e: usize) -> usize {
        self.most.map_or(self.compact[e], |m| e * m)
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

    /// Where a layer of `ne` experts splits, given each expert's rows in the batch (`used`)
    /// and, where the device pads every expert's group to `most` rows, that.
    pub fn split(&mut self, used: &[u32], most: Option<usize>) -> Split {
        let ne = used.len();
        let first = ne - self.count(ne);
        self.used = used.iter().map(|&c| c as usize).collect();
        self.compact.clear();
        let mut o = 0;
        for &c in &self.used {
            self.compact.push(o);
            o += c;
        }
        self.most = most;
        let end = most.map_or(o, |m| ne * m);
        let row = if first < ne { self.start(first) } else { end };
        Split {
            first,
            row,
            rows: end - row,
        }
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
    /// [`PromptCpuShare::prepare`] sized them, filled from the device, and the split of
    /// [`PromptCpuShare::split`]): each pair whose expert is `split.first` or later gets its
    /// token's input at its row of its expert's group, and each such expert's rows are
    /// computed: the outputs of rows `split.row..split.row + split.rows` in
    /// [`PromptCpuShare::output`] (padding rows as they were).
    pub fn compute(&mut self, l: usize, k: usize, split: Split) -> Result<(), CudaError> {
        let d = self.experts.d();
        let refuse = |what: String| {
            Err(CudaError::Model(format!(
                "the CPU tier in prompts: layer {l}'s {what}"
            )))
        };
        let (ne, rows) = (self.used.len(), split.rows);
        if split.first > ne || self.compact.len() != ne {
            return refuse(format!("split {split:?} of {ne} experts"));
        }
        let on_cpu: usize = self.used[split.first..].iter().sum();
        let on_gpu: usize = self.used[..split.first].iter().sum();
        self.x.resize(rows * d, 0.0);
        self.y_len = 0;
        if on_cpu == 0 {
            self.gpu_rows += on_gpu as u64;
            return Ok(());
        }
        // Each CPU expert's rows, from the counts; every pair of it in one of them, once.
        let mut groups: Vec<(u32, Range<usize>)> = Vec::new();
        for e in split.first..ne {
            let start = self.start(e).checked_sub(split.row);
            match start.filter(|&s| s + self.used[e] <= rows) {
                _ if self.used[e] == 0 => {}
                Some(s) => groups.push((e as u32, s..s + self.used[e])),
                None => return refuse(format!("expert {e}'s group outside the CPU's rows")),
            }
        }
        let mut filled = vec![false; rows];
        let mut seen = 0;
        for (i, (&e, &at)) in self.ids.iter().zip(&self.at).enumerate() {
            let (e, at) = (e as usize, at as usize);
            if e < split.first {
                continue;
            }
            let r = (e < ne)
                .then(|| at.checked_sub(self.compact[e]))
                .flatten()
                .filter(|&rank| rank < self.used[e])
                .map(|rank| self.start(e) + rank - split.row)
                .filter(|&r| !filled[r]);
            let Some(r) = r else {
                return refuse(format!(
                    "pair {i} (expert {e}) at row {at}, not a free row of its group"
                ));
            };
            (filled[r], seen) = (true, seen + 1);
            let t = i / k;
            self.x[r * d..(r + 1) * d].copy_from_slice(&self.normed[t * d..(t + 1) * d]);
        }
        if seen != on_cpu {
            return refuse(format!("{seen} pairs for the {on_cpu} rows of its groups"));
        }
        let y = (self.y.rows_mut(rows * d))
            .map_err(|e| CudaError::Model(format!("the CPU tier in prompts: {e}")))?;
        self.experts
            .grouped(&self.pool, l, &groups, &self.x, y)
            .map_err(|e| CudaError::Model(e.to_string()))?;
        self.y_len = rows * d;
        self.cpu_rows += on_cpu as u64;
        self.gpu_rows += on_gpu as u64;
        Ok(())
    }

    /// After a layer: the GPU had finished its groups by the time the CPU finished
    /// (`gpu_idle`: the CPU was the slower side at this count) or not. Between a count known
    /// to leave the CPU faster and one known to leave it slower, the next is halfway; with
    /// only one of them known, the count moves away from it one expert, then twice as many
    /// each layer (at most an eighth of them); a count seen on the other side than before
    /// replaces the old bound, so that the bracket follows a balance that drifts.
    pub fn adapt(&mut self, gpu_idle: bool, ne: usize) {
        if !self.adapt {
            return;
        }
        let c = self.count(ne);
        if gpu_idle {
            self.slower = Some(c);
            self.faster = self.faster.filter(|&f| f < c);
        } else {
            self.faster = Some(c);
            self.slower = self.slower.filter(|&s| s > c);
        }
        let most = (ne / 8).max(1);
        let mut grow = || {
            let s = self.step;
            self.step = (2 * s).min(most);
            s
        };
        let next = match (self.faster, self.slower) {
            (Some(f), Some(s)) if s > f + 1 => (f + s) / 2,
            (Some(f), Some(s)) => {
                if gpu_idle {
                    f
                } else {
                    s
                }
            }
            (Some(_), None) => c + grow(),
            (None, _) => c.saturating_sub(grow()),
        };
        if self.faster.is_some() && self.slower.is_some() {
            self.step = 1;
        }
        self.count = next.clamp(1, ne.max(2) - 1);
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
        PromptCpuShare::new(experts, 1, count, adapt).unwrap()
    }

    #[test]
    fn the_split_gives_the_cpu_the_last_experts_rows() {
        let mut s = share(3, false);
        assert!(s.serves(1) && !s.serves(0) && !s.serves(9));
        let used = [2, 0, 1, 4, 3, 0, 1, 5];
        let split = |first, row, rows| Split { first, row, rows };
        assert_eq!(s.split(&used, None), split(5, 10, 6));
        // Every group padded to 5 rows: the CPU's from expert 5's place on.
        assert_eq!(s.split(&used, Some(5)), split(5, 25, 15));
        // A fixed count may take every expert; an adapted one leaves the GPU one.
        assert_eq!(share(9, false).split(&[1, 1], None), split(0, 0, 2));
        assert_eq!(share(9, true).split(&[1, 1], None), split(1, 1, 1));
    }

    #[test]
    fn the_count_follows_the_side_that_finishes_first() {
        // Of 8 experts (a move of one at most): 3 -> 4 -> 5; the CPU slower at 5: back to 4.
        let mut s = share(3, true);
        s.adapt(false, 8);
        s.adapt(false, 8);
        assert_eq!(s.count(8), 5);
        s.adapt(true, 8);
        assert_eq!(s.count(8), 4);
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
        // Of 128, the sides even at 20 on the CPU, then at 60: from 48 the count is near 20
        // within 8 layers and stays there, then follows to 60.
        let mut s = share(48, true);
        let mut seen = Vec::new();
        for layer in 0..80 {
            let c = s.count(128);
            seen.push(c);
            s.adapt(c > if layer < 40 { 20 } else { 60 }, 128);
        }
        let near =
            |from: usize, to: usize, at: usize| seen[from..to].iter().all(|&c| c.abs_diff(at) <= 2);
        assert!(near(8, 40, 20) && near(52, 80, 60), "{seen:?}");
    }

    /// Two tokens of two pairs; expert 7 (the CPU's, of 8) chosen by pairs 1 and 2, at
    /// compact rows 2 and 3 (experts 0 and 3 at rows 0 and 1).
    fn two_tokens(s: &mut PromptCpuShare, padded: Option<usize>) -> Split {
        s.prepare(2, 2, s.experts.d());
        s.ids.copy_from_slice(&[0, 7, 7, 3]);
        s.at.copy_from_slice(&[0, 2, 3, 1]);
        s.normed
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 5) as f32 - 2.0);
        s.split(&[1, 0, 0, 1, 0, 0, 0, 2], padded)
    }

    #[test]
    fn rows_the_device_did_not_group_are_refused() {
        let mut s = share(1, false);
        let d = s.experts.d();
        let split = two_tokens(&mut s, None);
        assert_eq!(
            split,
            Split {
                first: 7,
                row: 2,
                rows: 2
            }
        );
        // Pair 2 at row 4: past its expert's group.
        s.at.copy_from_slice(&[0, 2, 4, 1]);
        let e = s.compute(1, 2, split).unwrap_err().to_string();
        assert!(e.contains("pair 2") && e.contains("row 4"), "{e}");
        // Both at row 2.
        s.at.copy_from_slice(&[0, 2, 2, 1]);
        let e = s.compute(1, 2, split).unwrap_err().to_string();
        assert!(e.contains("pair 2") && e.contains("row 2"), "{e}");
        // An expert past the layer's.
        s.ids.copy_from_slice(&[0, 7, 9, 3]);
        s.at.copy_from_slice(&[0, 2, 3, 1]);
        let e = s.compute(1, 2, split).unwrap_err().to_string();
        assert!(e.contains("expert 9"), "{e}");
        s.ids.copy_from_slice(&[0, 7, 7, 3]);
        s.compute(1, 2, split).unwrap();
        let compact = s.output().unwrap().to_vec();
        assert_eq!(compact.len(), 2 * d);
        assert_eq!(s.rows(), (2, 2));
        // Groups padded to 3 rows: the same two rows at the start of expert 7's group.
        let split = two_tokens(&mut s, Some(3));
        assert_eq!(
            split,
            Split {
                first: 7,
                row: 21,
                rows: 3
            }
        );
        s.compute(1, 2, split).unwrap();
        assert_eq!(&s.output().unwrap()[..2 * d], &compact[..]);
        assert_eq!(s.rows(), (4, 4));
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
        let split = two_tokens(&mut s, None);
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
