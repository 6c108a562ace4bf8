//! The backend interface: a model made ready on one device, holding sequences ("slots"), each
//! with its own position and caches, and evaluating a batch of (slot, ids) pairs per call.
//!
//! Every command, the library and the server's scheduler drive a model through [`Backend`]
//! alone; a backend never sees HTTP or a command line. What only some devices can do (choose
//! the next token on the device, queue the next step before the host has read the last one's
//! choice, count expert selections) is an optional method with a default that declines, so a
//! caller asks once and takes the general path otherwise; docs/ARCHITECTURE.md shows the whole
//! path of a request.

use std::sync::Arc;

use ferrolm_model::{ExpertCacheStats, Logits, Model, ModelError, Session};

use crate::sampler::SamplerParams;

/// Why a backend could not evaluate.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The model refused the input (an id outside the vocabulary, a full context, ...).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The device failed (a driver call, memory, ...).
    #[error("{0}")]
    Device(String),
    /// An optional capability this backend does not have was used without asking first.
    #[error("this backend cannot {0}")]
    Unsupported(&'static str),
}

impl BackendError {
    /// Whether the error is a full context (the request asked for more than fits).
    pub fn is_context_full(&self) -> bool {
        matches!(self, BackendError::Model(ModelError::ContextFull { .. }))
    }
}

/// One slot's work in a call: ids to evaluate after what its caches hold.
#[derive(Clone, Copy, Debug)]
pub struct SlotInput<'a> {
    /// The slot the ids belong to.
    pub slot: usize,
    /// The ids.
    pub ids: &'a [u32],
    /// Which of their logits to return.
    pub want: Logits,
}

/// The outcome of one slot's work: the logits asked for (empty for [`Logits::None`]). An error
/// is shared, since a batched call that fails fails for every slot in it.
pub type SlotOutput = Result<Vec<f32>, Arc<BackendError>>;

/// One input's largest logits as (id, logit) ([`Backend::forward_top`]), or the shared error.
pub type TopOutput = Result<Vec<(u32, f32)>, Arc<BackendError>>;

/// A model on a device, with its slots (see the module documentation).
pub trait Backend {
    /// Where it runs, in words ("CPU", "CUDA (NVIDIA H200)").
    fn describe(&self) -> String;
    /// Slots (sequences with their own caches).
    fn n_slots(&self) -> usize;
    /// Positions each slot holds.
    fn n_ctx(&self) -> usize;
    /// Entries of a row of logits.
    fn n_vocab(&self) -> usize;
    /// Positions `slot` holds.
    fn position(&self, slot: usize) -> usize;
    /// Goes back to position `pos` of `slot`, keeping what came before (0 empties it), and
    /// returns the position it kept: a cache that cannot go back that far (a sliding-window
    /// ring, a recurrent state) may keep less, and the caller evaluates the ids from there.
    fn truncate(&mut self, slot: usize, pos: usize) -> Result<usize, BackendError>;
    /// Evaluates every input (at most one per slot) and returns one output per input, in order.
    fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput>;

    /// Sets aside room for `slot` to hold `positions` positions, kept until
    /// [`Backend::release`]: `Ok(false)` when other slots' requests hold the room now (a
    /// device whose caches are paged from a pool); the caller waits for one to end, or
    /// pauses one. An error when `positions` could never fit. Setting room aside may take the
    /// cache of a released slot, whose [`Backend::position`] then falls to 0. A backend whose
    /// caches hold every slot's whole context always has room (the default).
    fn reserve(&mut self, _slot: usize, _positions: usize) -> Result<bool, BackendError> {
        Ok(true)
    }

    /// `slot`'s request has ended: its room may go to other slots (what its cache holds
    /// stays until then, for a later prompt that starts the same way).
    fn release(&mut self, _slot: usize) {}

    /// [`Backend::forward`] for inputs that each want their last logits only to take the
    /// largest (greedy decoding without penalties): returns each one's greedy choice (the
    /// first largest logit, as [`argmax`](crate::argmax)). A backend that can keeps the
    /// logits where they are (a GPU's memory) and returns only the ids.
    fn forward_greedy(&mut self, inputs: &[SlotInput<'_>]) -> Vec<Result<u32, Arc<BackendError>>> {
        self.forward(inputs)
            .into_iter()
            .map(|r| r.map(|logits| crate::argmax(&logits)))
            .collect()
    }

    /// [`Backend::forward`] for inputs that each want only their last logits' `k` largest
    /// (a sampler with a top-k of at most `k` and no penalties needs no more): returns each
    /// one's `k` largest as (id, logit), in no particular order. A backend that can keeps the
    /// logits where they are and returns only these.
    fn forward_top(&mut self, inputs: &[SlotInput<'_>], k: usize) -> Vec<TopOutput> {
        self.forward(inputs)
            .into_iter()
            .map(|r| r.map(|logits| crate::sampler::top_k(&logits, k)))
            .collect()
    }

    /// Asks the device to choose `slot`'s tokens itself with `sampler` after every evaluation
    /// that computes last logits (`None`: the host samples again). `Ok(false)`: this backend or
    /// this sampler cannot, and the host samples from the logits [`Backend::forward`] returns.
    fn sample_on_device(
        &mut self,
        _slot: usize,
        _sampler: Option<&SamplerParams>,
    ) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// With device sampling: the id the device chose at `slot`'s last evaluation (waits for it).
    fn chosen(&mut self, _slot: usize) -> Result<u32, BackendError> {
        Err(BackendError::Unsupported("choose tokens on the device"))
    }

    /// With device sampling: queues the evaluation of the id the device chose at `slot`'s last
    /// step (choosing the next one after it) and returns that id, without waiting for the new
    /// step: the device runs ahead of the host by one step.
    fn step_chosen(&mut self, _slot: usize) -> Result<u32, BackendError> {
        Err(BackendError::Unsupported("queue steps on the device"))
    }

    /// A line on how the last decode steps used the device, given their speed and mid-run
    /// position (bytes read per token, launches), for `bench`; `None` where there is nothing
    /// to say.
    fn decode_report(&self, _tokens_per_s: f64, _position: usize) -> Option<String> {
        None
    }

    /// How often each expert of each mixture-of-experts layer was chosen (empty per dense
    /// layer), where the backend counts (`None`: it does not).
    fn expert_counts(&self) -> Option<Vec<Vec<u64>>> {
        None
    }

    /// The streamed-experts cache's counters, where experts are streamed.
    fn expert_cache_stats(&self) -> Option<ExpertCacheStats> {
        None
    }

    /// Where the experts' selections were served from, where a memory budget split the
    /// experts between the device and host memory (`None`: all in one place).
    fn expert_tier_stats(&self) -> Option<ExpertTierStats> {
        None
    }
}

/// Where a backend's expert selections were served from under a device memory budget
/// (`--gpu-memory`), from its selection counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertTierStats {
    /// Bytes of expert rows in device memory.
    pub device_expert_bytes: u64,
    /// Bytes of expert rows left in host memory.
    pub host_expert_bytes: u64,
    /// Selections (one token choosing one expert in one layer) served from device memory.
    pub device_selections: u64,
    /// Selections that read rows in host memory.
    pub host_selections: u64,
    /// Of those, the selections the CPU computed (the CPU tier: decode steps' last experts
    /// and prompt batches' groups of the last experts), reading host memory, not the bus.
    pub cpu_selections: u64,
    /// Bytes of host-memory rows those selections read (each selection's; a prompt batch
    /// reads a shared expert's rows once for its tokens, so the bus moves at most this).
    pub host_bytes: u64,
}

impl ExpertTierStats {
    /// Device selections over all selections (0 before any).
    pub fn device_share(&self) -> f64 {
        ferrolm_model::share(self.device_selections, self.host_selections)
    }
}

/// The CPU backend: one [`Session`] per slot; a call over several slots is one forward pass
/// (every matrix product takes all their tokens together, each slot attends over its own
/// cache, `Model::eval_many`), a call over one slot is that session's own evaluation.
pub struct CpuBackend<'m> {
    model: &'m Model,
    sessions: Vec<Session<'m>>,
    n_ctx: usize,
}

impl<'m> CpuBackend<'m> {
    /// `n_slots` sessions of `n_ctx` positions each.
    pub fn new(model: &'m Model, n_slots: usize, n_ctx: usize) -> CpuBackend<'m> {
        CpuBackend {
            model,
            sessions: (0..n_slots.max(1)).map(|_| model.session(n_ctx)).collect(),
            n_ctx,
        }
    }
}

impl Backend for CpuBackend<'_> {
    fn describe(&self) -> String {
        "CPU".into()
    }

    fn n_slots(&self) -> usize {
        self.sessions.len()
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn n_vocab(&self) -> usize {
        self.model.plan().n_vocab
    }

    fn position(&self, slot: usize) -> usize {
        self.sessions[slot].position()
    }

    fn truncate(&mut self, slot: usize, pos: usize) -> Result<usize, BackendError> {
        let session = &mut self.sessions[slot];
        session.truncate(pos);
        Ok(session.position())
    }

    fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
        if let [one] = inputs {
            // One sequence: its session's batches of `BATCH` (and a recurrent model's
            // checkpoint at the end of a prompt), as a single generation always ran.
            let out = self.sessions[one.slot].eval(one.ids, one.want);
            return vec![out.map_err(|e| Arc::new(e.into()))];
        }
        // The sessions in the order of the inputs (at most one input per slot).
        let mut by_slot: Vec<Option<&mut Session<'_>>> =
            self.sessions.iter_mut().map(Some).collect();
        let mut items = Vec::with_capacity(inputs.len());
        for input in inputs {
            let session = by_slot[input.slot]
                .take()
                .expect("at most one input per slot");
            items.push((session, input.ids, input.want));
        }
        self.model
            .eval_many(&mut items)
            .into_iter()
            .map(|r| r.map_err(|e| Arc::new(e.into())))
            .collect()
    }

    fn expert_counts(&self) -> Option<Vec<Vec<u64>>> {
        Some(self.model.expert_counts())
    }

    fn expert_cache_stats(&self) -> Option<ExpertCacheStats> {
        self.model.expert_cache_stats()
    }
}
