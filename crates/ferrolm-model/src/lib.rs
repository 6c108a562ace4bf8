//! Models: architectures described as layer plans, weights bound from GGUF files, and the CPU
//! forward pass with its KV cache.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod arch;
mod cpu;
mod error;
mod experts;
mod host_experts;
mod kv_cache;
pub mod plan;
pub mod shapes;
pub mod synthetic;
mod synthetic_moe;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use ferrolm_gguf::GgufFile;

pub use cpu::forward::Logits;
pub use error::{ModelError, Result};
pub use experts::{
    share, ExpertCacheStats, ExpertMode, LoadOptions, AUTO_CACHE_SHARE, STREAM_ABOVE_SHARE,
};
pub use host_experts::HostExperts;
pub use kv_cache::KvCache;
pub use plan::ModelPlan;
pub use weights::{Matrix, Weights};

/// A loaded model: its plan, and its weights in the mapped file.
pub struct Model {
    plan: ModelPlan,
    weights: Weights,
    file: Arc<GgufFile>,
    pool: ferrolm_threads::ThreadPool,
    /// Where the experts' weights come from (mapped, or streamed through a cache).
    experts: Arc<experts::ExpertStore>,
    /// Per layer, how many times each expert was selected (empty for dense layers).
    expert_counts: Vec<Vec<std::sync::atomic::AtomicU64>>,
    /// Where forward passes write their intermediate tensors ([`Model::set_dump_dir`]).
    dump_dir: Option<std::path::PathBuf>,
}

impl Model {
    /// Loads the model at `path`, running on `threads` threads (0: every core), its experts
    /// (if any) placed by [`ExpertMode::Auto`].
    pub fn load(path: impl AsRef<Path>, threads: usize) -> Result<Model> {
        Model::from_file(Arc::new(GgufFile::open(path)?), threads)
    }

    /// Loads a model from an open file, its experts (if any) placed by [`ExpertMode::Auto`].
    pub fn from_file(file: Arc<GgufFile>, threads: usize) -> Result<Model> {
        let options = LoadOptions {
            threads,
            ..Default::default()
        };
        Model::from_file_with(file, &options)
    }

    /// Loads the model at `path` as `options` say.
    pub fn load_with(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Model> {
        Model::from_file_with(Arc::new(GgufFile::open(path)?), options)
    }

    /// Loads a model from an open file as `options` say.
    pub fn from_file_with(file: Arc<GgufFile>, options: &LoadOptions) -> Result<Model> {
        let plan = arch::describe(&file)?;
        let weights = weights::bind(&file, &plan, &options.kernels)?;
        let experts = experts::ExpertStore::new(options.experts, &file, &plan, &weights)?;
        let threads = options.threads;
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = ferrolm_threads::ThreadPool::new(threads)
            .map_err(|e| ModelError::Invalid(format!("cannot start {threads} threads: {e}")))?;
        let expert_counts = plan
            .layers
            .iter()
            .map(|l| match &l.ffn {
                plan::Ffn::Moe(m) => (0..m.n_expert).map(|_| Default::default()).collect(),
                plan::Ffn::Gated { .. } => Vec::new(),
            })
            .collect();
        Ok(Model {
            plan,
            weights,
            file,
            pool,
            experts: Arc::new(experts),
            expert_counts,
            dump_dir: None,
        })
    }

    /// Makes every forward pass write its intermediate tensors into `dir`, one little-endian
    /// f32 file each under llama.cpp's names (`attn_norm-0.f32`, `ffn_out-3.f32`...), for a
    /// tensor-by-tensor comparison with llama.cpp (scripts/dump_compare.py); `None`: off.
    /// A later pass overwrites an earlier one's files.
    pub fn set_dump_dir(&mut self, dir: Option<std::path::PathBuf>) {
        self.dump_dir = dir;
    }

    /// The streamed-expert cache's counters, or `None` when the experts are resident (or the
    /// model has none).
    pub fn expert_cache_stats(&self) -> Option<ExpertCacheStats> {
        self.experts.stats()
    }

    /// Per layer, how many times each expert has been selected by the tokens this model has
    /// run so far (one count per token and selected expert; empty for dense layers).
    pub fn expert_counts(&self) -> Vec<Vec<u64>> {
        self.expert_counts
            .iter()
            .map(|l| {
                l.iter()
                    .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
                    .collect()
            })
            .collect()
    }

    /// The plan.
    pub fn plan(&self) -> &ModelPlan {
        &self.plan
    }

    /// The file the weights come from.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The bound weights: each layer's matrices (views into [`Model::file`]'s bytes) and
    /// vectors, which every executor reads (the CUDA backend uploads them).
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Threads the forward pass uses.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// A new sequence with room for `n_ctx` positions (0: the trained context length).
    pub fn session(&self, n_ctx: usize) -> Session<'_> {
        let n_ctx = if n_ctx == 0 {
            self.plan.n_ctx_train
        } else {
            n_ctx
        };
        Session {
            model: self,
            cache: KvCache::new(&self.plan, n_ctx),
            scratch: Default::default(),
            pos: 0,
            high: 0,
            checkpoint: None,
        }
    }
}

/// One sequence: its KV cache and how far it has got.
pub struct Session<'m> {
    model: &'m Model,
    cache: KvCache,
    scratch: cpu::forward::Scratch,
    pos: usize,
    /// Positions written since the cache was last emptied (sliding-window rings forget the
    /// oldest of them; see [`Session::truncate`]).
    high: usize,
    /// A model with recurrent layers: their states as they were at the end of the last prompt
    /// (the position, the states), so that going back to a position at or after it (a chat's
    /// next turn, which re-renders the last reply) resumes there instead of starting over.
    checkpoint: Option<(usize, kv_cache::SavedStates)>,
}

/// Tokens evaluated in one forward pass during prompt processing.
pub const BATCH: usize = 512;

impl Session<'_> {
    /// Positions filled so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions the context holds.
    pub fn n_ctx(&self) -> usize {
        self.cache.n_ctx()
    }

    /// Forgets everything: the next token goes to position 0.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.high = 0;
        self.checkpoint = None;
    }

    /// Goes back to position `pos`, keeping what came before it; read [`Session::position`]
    /// afterwards: a model with sliding-window layers keeps only a ring of recent positions, so
    /// going back further than the ring allows (about 512 positions past the window) starts
    /// over at 0, and the caller evaluates the ids from there again. A model with recurrent
    /// layers (gated delta-nets) holds their state at the current position, and as it was at
    /// the end of the last prompt evaluated: going back to an earlier position resumes from
    /// that checkpoint when it lies at or before `pos`, and starts over at 0 otherwise
    /// (recomputing is the caller's, from its ids).
    pub fn truncate(&mut self, pos: usize) {
        let pos = self.pos.min(pos);
        if pos > 0 && self.cache.can_rewind(self.high, pos) {
            self.pos = pos;
            return;
        }
        if let Some((at, states)) = &self.checkpoint {
            if *at <= pos && *at > 0 && self.cache.can_rewind_keys(self.high, *at) {
                self.cache.restore_states(states);
                self.pos = *at;
                return;
            }
        }
        self.reset();
    }

    /// Evaluates `ids` after what the session holds, in batches of [`BATCH`], and returns the
    /// logits asked for (`All`: one row of `n_vocab` per id).
    pub fn eval(&mut self, ids: &[u32], want: Logits) -> Result<Vec<f32>> {
        self.check(ids)?;
        let logits = self.eval_batches(ids, want, None)?;
        self.checkpoint_prompt(ids.len());
        Ok(logits)
    }

    /// After a prompt (more than one id) on a model with recurrent layers: its states become
    /// the checkpoint [`Session::truncate`] can go back to.
    fn checkpoint_prompt(&mut self, n_ids: usize) {
        if n_ids > 1 {
            if let Some(states) = self.cache.states() {
                self.checkpoint = Some((self.pos, states));
            }
        }
    }

    /// Evaluates `ids` after what the session holds from layer `first` on, their residual
    /// stream after the earlier layers given in `hidden` (`ids.len()` rows of `n_embd`,
    /// token-major): the layers before `first` ran elsewhere (a GPU, `--gpu-layers`), and this
    /// session's cache of those layers stays unused. Returns the logits asked for.
    pub fn eval_from(
        &mut self,
        ids: &[u32],
        first: usize,
        hidden: &[f32],
        want: Logits,
    ) -> Result<Vec<f32>> {
        self.check(ids)?;
        let d = self.model.plan.n_embd;
        if first > self.model.plan.layers.len() || hidden.len() != ids.len() * d {
            return Err(ModelError::Unsupported {
                what: "start of a partial forward pass",
                value: format!(
                    "layer {first} of {}, {} hidden values for {} tokens of {d}",
                    self.model.plan.layers.len(),
                    hidden.len(),
                    ids.len()
                ),
            });
        }
        self.eval_batches(ids, want, Some((first, hidden)))
    }

    /// The forward passes of [`Session::eval`] and [`Session::eval_from`], [`BATCH`] ids each.
    fn eval_batches(
        &mut self,
        ids: &[u32],
        want: Logits,
        start: Option<(usize, &[f32])>,
    ) -> Result<Vec<f32>> {
        let d = self.model.plan.n_embd;
        let mut out = Vec::new();
        let n_chunks = ids.len().div_ceil(BATCH);
        for (i, chunk) in ids.chunks(BATCH).enumerate() {
            let w = match want {
                Logits::All => Logits::All,
                Logits::Last if i + 1 == n_chunks => Logits::Last,
                _ => Logits::None,
            };
            let mut seq = [cpu::forward::SeqInput {
                cache: &mut self.cache,
                ids: chunk,
                pos0: self.pos,
                want: w,
            }];
            let start = start.map(|(layer, hidden)| cpu::forward::Start {
                layer,
                hidden: &hidden[i * BATCH * d..(i * BATCH + chunk.len()) * d],
            });
            let logits = cpu::forward::forward(self.model, &mut self.scratch, &mut seq, start)?;
            out.extend_from_slice(&logits[0]);
            self.pos += chunk.len();
            self.high = self.high.max(self.pos);
        }
        Ok(out)
    }

    /// Whether `ids` can follow what the session holds: ids in the vocabulary, room in the
    /// context.
    fn check(&self, ids: &[u32]) -> Result<()> {
        let n_vocab = self.model.plan.n_vocab;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= n_vocab) {
            return Err(ModelError::TokenOutOfRange { id, n_vocab });
        }
        let needed = self.pos + ids.len();
        if needed > self.cache.n_ctx() {
            return Err(ModelError::ContextFull {
                needed,
                n_ctx: self.cache.n_ctx(),
            });
        }
        Ok(())
    }
}

impl Model {
    /// Evaluates several sessions' new tokens in one forward pass (continuous batching): every
    /// matrix product takes all their tokens together, each session attends over its own
    /// cache. Each item gets its own result: an item that fails its checks (an id outside the
    /// vocabulary, a full context) gets its error and is left out of the pass. All sessions
    /// must belong to this model.
    pub fn eval_many(
        &self,
        items: &mut [(&mut Session<'_>, &[u32], Logits)],
    ) -> Vec<Result<Vec<f32>>> {
        let mut results: Vec<Option<Result<Vec<f32>>>> = Vec::with_capacity(items.len());
        let mut scratch = cpu::forward::Scratch::default();
        let mut batch = Vec::new();
        // Where each evaluated session was, to go back there if the pass fails.
        let mut before = Vec::new();
        for (session, ids, want) in items.iter_mut() {
            assert!(
                std::ptr::eq(session.model, self),
                "a session of another model"
            );
            match session.check(ids) {
                Err(e) => results.push(Some(Err(e))),
                Ok(()) if ids.is_empty() => results.push(Some(Ok(Vec::new()))),
                Ok(()) => {
                    results.push(None);
                    let pos0 = session.pos;
                    before.push((pos0, session.high));
                    session.pos += ids.len();
                    session.high = session.high.max(session.pos);
                    batch.push(cpu::forward::SeqInput {
                        cache: &mut session.cache,
                        ids,
                        pos0,
                        want: *want,
                    });
                }
            }
        }
        let outputs = if batch.is_empty() {
            Ok(Vec::new())
        } else {
            cpu::forward::forward(self, &mut scratch, &mut batch, None)
        };
        drop(batch);
        let outputs = match outputs {
            Ok(o) => o,
            Err(e) => {
                // Every evaluated session goes back to where it was and gets the error.
                let message = e.to_string();
                let mut before = before.into_iter();
                for ((session, _, _), r) in items.iter_mut().zip(&mut results) {
                    if r.is_none() {
                        let (pos, high) = before.next().expect("one per evaluated item");
                        session.pos = pos;
                        session.high = high;
                        *r = Some(Err(ModelError::BatchFailed(message.clone())));
                    }
                }
                Vec::new()
            }
        };
        let mut logits = outputs.into_iter();
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Ok(logits.next().expect("one output per evaluated item"))))
            .collect()
    }
}
