//! The CUDA backends behind ferrolm-engine's [`Backend`]: the whole model on one GPU
//! ([`CudaBackend`]), or its first layers there and the rest on the CPU ([`SplitBackend`],
//! `--gpu-layers`), and [`open`], which makes the one a configuration asks for.
//!
//! [`CudaBackend`] holds several sequences ("slots") over one copy of the weights: slot 0 is
//! the decode graph's (one launch per token, the device choosing and running ahead), and a
//! step of several slots' tokens is one batched pass (every weight read once for all of them,
//! attention per token over its own slot's cache). [`SplitBackend`] has one slot.

use std::sync::Arc;

use ferrolm_engine::{Backend, BackendError, SamplerParams, SlotInput, SlotOutput, TopOutput};
use ferrolm_model::{Logits, Model, ModelError, Session};
use rand::{Rng, SeedableRng};

use crate::schedule::SAMPLE_MAX_K;
use crate::{CudaError, CudaModel, CudaTuning, DeviceSampling, Rows, RowsWant, Stats, TOP_MAX};

/// What [`open`] makes.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// The CUDA device.
    pub ordinal: usize,
    /// Positions of the context.
    pub n_ctx: usize,
    /// Layers on the GPU, the rest and the output head on the CPU (`None` or at least the
    /// model's layer count: all of them).
    pub gpu_layers: Option<usize>,
    /// Sequences held at once (the whole model only; at least 1).
    pub slots: usize,
    /// The backend's switches and sizes.
    pub tuning: CudaTuning,
}

/// The backend `options` ask for on `model`: the whole model on the GPU, or its first layers.
pub fn open<'m>(
    model: &'m Model,
    options: &CudaOptions,
) -> Result<Box<dyn Backend + 'm>, CudaError> {
    let layers = options.gpu_layers.unwrap_or(usize::MAX);
    let whole = layers >= model.plan().layers.len();
    let (ordinal, n_ctx) = (options.ordinal, options.n_ctx);
    let tuning = &options.tuning;
    let one = || CudaModel::with_slots(model, ordinal, n_ctx, layers, 1, tuning);
    let gpu = if whole && options.slots > 1 {
        match CudaModel::with_slots(model, ordinal, n_ctx, layers, options.slots, tuning) {
            Err(CudaError::Model(why)) => {
                eprintln!("ferrolm: {why}; one sequence at a time");
                one()?
            }
            other => other?,
        }
    } else {
        one()?
    };
    if gpu.is_whole() {
        if let Some(pool) = gpu.kv_pool_bytes() {
            let whole = gpu.n_slots() as u64 * gpu.plan().kv_bytes_total();
            eprintln!(
                "ferrolm: KV caches paged from a pool of {} MB ({} sequences' whole contexts \
                 would take {} MB); a request waits while others hold it",
                pool >> 20,
                gpu.n_slots(),
                whole >> 20
            );
        }
        return Ok(Box::new(CudaBackend::new(gpu)));
    }
    Ok(Box::new(SplitBackend {
        cpu: model.session(options.n_ctx),
        gpu,
        n_layers: model.plan().layers.len(),
    }))
}

fn device_error(e: CudaError) -> BackendError {
    match e {
        CudaError::ContextFull { n_ctx } => BackendError::Model(ModelError::ContextFull {
            needed: n_ctx + 1,
            n_ctx,
        }),
        e => BackendError::Device(format!("CUDA: {e}")),
    }
}

fn one_slot(slot: usize) -> Result<(), BackendError> {
    if slot == 0 {
        Ok(())
    } else {
        Err(BackendError::Model(ModelError::Unsupported {
            what: "slot",
            value: format!("{slot} (the CUDA backend holds one sequence)"),
        }))
    }
}

/// The device sampler's settings when it can serve `s` (no penalties, which need the history;
/// a top-k of at most [`SAMPLE_MAX_K`]); `Ok(None)`: greedy on the device; `Err`: the host.
#[allow(clippy::result_unit_err)] // The error carries nothing: the host samples.
pub fn device_sampling(s: &SamplerParams) -> Result<Option<DeviceSampling>, ()> {
    let no_penalties =
        s.repeat_penalty == 1.0 && s.presence_penalty == 0.0 && s.frequency_penalty == 0.0;
    if !no_penalties {
        return Err(());
    }
    if s.temperature <= 0.0 {
        return Ok(None);
    }
    if !(1..=SAMPLE_MAX_K).contains(&s.top_k) {
        return Err(());
    }
    Ok(Some(DeviceSampling {
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        temperature: s.temperature,
    }))
}

/// The whole model on one GPU (see the module documentation).
pub struct CudaBackend {
    gpu: CudaModel,
    /// Each slot's position (slot 0's is the model's own).
    positions: Vec<usize>,
    /// The draws of device sampling (the host sampler's generator, seeded alike), while on.
    draws: Option<rand::rngs::StdRng>,
    /// The counters when the sequence last started, for [`Backend::decode_report`].
    since: Stats,
    /// The expert counters as last read from the device, when, and the tokens evaluated then.
    expert_counts: std::cell::RefCell<Option<ExpertCounts>>,
}

/// A reading of the device's expert counters.
struct ExpertCounts {
    tokens: u64,
    at: std::time::Instant,
    counts: Vec<Vec<u64>>,
}

/// [`Backend::expert_counts`] reads the device's counters again (a reading waits for the
/// device; the server asks after every step) once this many tokens or this long have passed
/// since the last reading, and something was evaluated since.
const EXPERT_COUNTS_EVERY: (u64, std::time::Duration) = (64, std::time::Duration::from_millis(100));

impl CudaBackend {
    /// The backend over a model already on the device.
    pub fn new(gpu: CudaModel) -> CudaBackend {
        let since = gpu.stats();
        CudaBackend {
            positions: vec![0; gpu.n_slots()],
            gpu,
            draws: None,
            since,
            expert_counts: std::cell::RefCell::new(None),
        }
    }

    /// The model on the device (`cuda-check` and profiling reach past the interface).
    pub fn model(&mut self) -> &mut CudaModel {
        &mut self.gpu
    }

    /// `f` of the expert counters (each layer's counts; empty per dense layer), read from the
    /// device again where [`EXPERT_COUNTS_EVERY`] says the last reading is stale; `None` for a
    /// model without experts or before a first reading.
    fn with_expert_counts<T>(&self, f: impl FnOnce(&[Vec<u64>]) -> T) -> Option<T> {
        if self.gpu.plan().max_experts == 0 {
            return None;
        }
        let tokens = self.gpu.stats().tokens;
        let mut cached = self.expert_counts.borrow_mut();
        let (every, after) = EXPERT_COUNTS_EVERY;
        let stale = cached.as_ref().is_none_or(|c| {
            tokens != c.tokens && (tokens >= c.tokens + every || c.at.elapsed() >= after)
        });
        if stale {
            // (a failed read keeps the last counts: the next step's error says what went wrong)
            if let Ok(counts) = self.gpu.expert_counts() {
                *cached = Some(ExpertCounts {
                    tokens,
                    at: std::time::Instant::now(),
                    counts,
                });
            }
        }
        cached.as_ref().map(|c| f(&c.counts))
    }

    /// Before a step that may draw: the device's draws topped up.
    fn ensure_draws(&mut self) -> Result<(), CudaError> {
        if let Some(rng) = self.draws.as_mut() {
            self.gpu.ensure_draws(&mut || rng.random::<f32>())?;
        }
        Ok(())
    }
}

impl CudaBackend {
    fn pos(&self, slot: usize) -> usize {
        if slot == 0 {
            self.gpu.position()
        } else {
            self.positions[slot]
        }
    }

    fn check(&self, input: &SlotInput<'_>) -> Result<(), BackendError> {
        if input.slot >= self.gpu.n_slots() {
            return Err(BackendError::Model(ModelError::Unsupported {
                what: "slot",
                value: format!("{} (the device holds {})", input.slot, self.gpu.n_slots()),
            }));
        }
        let needed = self.pos(input.slot) + input.ids.len();
        if needed > self.gpu.n_ctx() {
            return Err(BackendError::Model(ModelError::ContextFull {
                needed,
                n_ctx: self.gpu.n_ctx(),
            }));
        }
        Ok(())
    }

    /// Room for `input` in its slot's cache, set aside now where the caller did not
    /// ([`Backend::reserve`]).
    fn make_room(&mut self, input: &SlotInput<'_>) -> Result<(), BackendError> {
        let needed = self.pos(input.slot) + input.ids.len();
        let room = self.gpu.ensure_room(input.slot, needed);
        self.forget_evicted();
        room.map_err(device_error)
    }

    /// Slots whose caches the device gave away hold nothing now.
    fn forget_evicted(&mut self) {
        for s in self.gpu.take_evicted() {
            self.positions[s] = 0;
        }
    }

    /// Evaluates one slot's ids alone: slot 0 through the decode graph (or its prompt
    /// batches), another slot through the batched passes.
    fn eval_alone(&mut self, input: &SlotInput<'_>) -> Result<Vec<f32>, BackendError> {
        let all = input.want == Logits::All;
        if input.ids.is_empty() {
            return Ok(Vec::new());
        }
        let out = if input.slot == 0 {
            self.ensure_draws().map_err(device_error)?;
            self.gpu.eval(input.ids, all)
        } else {
            let pos = self.positions[input.slot];
            let out = self.gpu.eval_slot(input.slot, pos, input.ids, all);
            if out.is_ok() {
                self.positions[input.slot] += input.ids.len();
            }
            out
        }
        .map_err(device_error)?;
        Ok(if input.want == Logits::None {
            Vec::new()
        } else {
            out
        })
    }

    /// Evaluates `inputs`: prompts one slot at a time, then every single-id input in one
    /// batched step (slot 0 alone takes the decode graph). Single ids of a batched step come
    /// back as `want` says (logits, greedy choices, or the largest logits).
    fn eval_all(
        &mut self,
        inputs: &[SlotInput<'_>],
        want: RowsWant,
    ) -> Vec<Result<Out, BackendError>> {
        let mut outs: Vec<Option<Result<Out, BackendError>>> =
            inputs.iter().map(|_| None).collect();
        let mut singles = Vec::new();
        // Room first for every input: one slot's room may take an idle slot's cache, and an
        // input of that slot would then continue from a cache that is gone.
        let before: Vec<usize> = inputs
            .iter()
            .map(|i| self.pos(i.slot.min(self.gpu.n_slots() - 1)))
            .collect();
        for (i, input) in inputs.iter().enumerate() {
            if let Err(e) = self.check(input).and_then(|_| self.make_room(input)) {
                outs[i] = Some(Err(e));
            }
        }
        for (i, input) in inputs.iter().enumerate() {
            if outs[i].is_some() {
                continue;
            }
            if self.pos(input.slot) != before[i] {
                outs[i] = Some(Err(BackendError::Device(format!(
                    "CUDA: slot {}'s cache was given to another sequence (reserve room first)",
                    input.slot
                ))));
            } else if input.ids.len() == 1 {
                singles.push(i);
            } else {
                outs[i] = Some(self.eval_alone(input).map(Out::Logits));
            }
        }
        if let [i] = singles[..] {
            if inputs[i].slot == 0 {
                // The decode graph; greedy, it reads back only the device's choice.
                outs[i] = Some(if want == RowsWant::Greedy && self.draws.is_none() {
                    self.gpu
                        .push(inputs[i].ids[0])
                        .and_then(|_| self.gpu.greedy())
                        .map(Out::Chosen)
                        .map_err(device_error)
                } else {
                    self.eval_alone(&inputs[i]).map(Out::Logits)
                });
                singles.clear();
            }
        }
        if !singles.is_empty() {
            let ids: Vec<u32> = singles.iter().map(|&i| inputs[i].ids[0]).collect();
            let slots: Vec<u32> = singles.iter().map(|&i| inputs[i].slot as u32).collect();
            let pos: Vec<u32> = singles
                .iter()
                .map(|&i| self.pos(inputs[i].slot) as u32)
                .collect();
            match self.gpu.eval_rows(&ids, &slots, &pos, want) {
                Ok(rows) => {
                    for &i in &singles {
                        if inputs[i].slot != 0 {
                            self.positions[inputs[i].slot] += 1;
                        }
                    }
                    let n_vocab = self.gpu.plan().n_vocab;
                    match rows {
                        Rows::Greedy(chosen) => {
                            for (&i, id) in singles.iter().zip(chosen) {
                                outs[i] = Some(Ok(Out::Chosen(id)));
                            }
                        }
                        Rows::Top(top) => {
                            for (&i, t) in singles.iter().zip(top) {
                                outs[i] = Some(Ok(Out::Top(t)));
                            }
                        }
                        Rows::Logits(l) => {
                            for (&i, row) in singles.iter().zip(l.chunks_exact(n_vocab)) {
                                let keep = inputs[i].want != Logits::None;
                                outs[i] = Some(Ok(Out::Logits(if keep {
                                    row.to_vec()
                                } else {
                                    Vec::new()
                                })));
                            }
                        }
                    }
                }
                Err(e) => {
                    let message = e.to_string();
                    for &i in &singles {
                        outs[i] = Some(Err(BackendError::Device(format!("CUDA: {message}"))));
                    }
                }
            }
        }
        outs.into_iter()
            .map(|o| o.expect("every input has an outcome"))
            .collect()
    }
}

/// One input's outcome inside [`CudaBackend`].
enum Out {
    Logits(Vec<f32>),
    Chosen(u32),
    Top(Vec<(u32, f32)>),
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        format!("CUDA ({})", self.gpu.device_name())
    }

    fn n_slots(&self) -> usize {
        self.gpu.n_slots()
    }

    fn n_ctx(&self) -> usize {
        self.gpu.n_ctx()
    }

    fn n_vocab(&self) -> usize {
        self.gpu.plan().n_vocab
    }

    fn position(&self, slot: usize) -> usize {
        self.pos(slot)
    }

    fn truncate(&mut self, slot: usize, pos: usize) -> Result<usize, BackendError> {
        if slot >= self.gpu.n_slots() {
            return one_slot(slot).map(|_| 0);
        }
        if slot == 0 {
            self.gpu.truncate(pos).map_err(device_error)?;
            if pos == 0 {
                self.since = self.gpu.stats();
            }
        } else {
            // (a recurrent state holds only the latest position: going back starts over)
            let keep = pos.min(self.positions[slot]);
            let recurrent = self.gpu.plan().recurrent() && keep < self.positions[slot];
            self.positions[slot] = if recurrent { 0 } else { keep };
        }
        Ok(self.pos(slot))
    }

    fn reserve(&mut self, slot: usize, positions: usize) -> Result<bool, BackendError> {
        if slot >= self.gpu.n_slots() {
            return one_slot(slot).map(|_| true);
        }
        let room = self.gpu.reserve(slot, positions);
        self.forget_evicted();
        room.map_err(device_error)
    }

    fn release(&mut self, slot: usize) {
        self.gpu.release(slot);
    }

    fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
        self.eval_all(inputs, RowsWant::Logits)
            .into_iter()
            .map(|r| match r {
                Ok(Out::Logits(l)) => Ok(l),
                Ok(Out::Chosen(_) | Out::Top(_)) => unreachable!("logits were asked for"),
                Err(e) => Err(std::sync::Arc::new(e)),
            })
            .collect()
    }

    fn forward_top(&mut self, inputs: &[SlotInput<'_>], k: usize) -> Vec<TopOutput> {
        let k = k.clamp(1, TOP_MAX);
        self.eval_all(inputs, RowsWant::Top(k))
            .into_iter()
            .map(|r| match r {
                Ok(Out::Top(t)) => Ok(t),
                Ok(Out::Logits(l)) => Ok(ferrolm_engine::top_k(&l, k)),
                Ok(Out::Chosen(id)) => Ok(vec![(id, 0.0)]),
                Err(e) => Err(Arc::new(e)),
            })
            .collect()
    }

    fn forward_greedy(&mut self, inputs: &[SlotInput<'_>]) -> Vec<Result<u32, Arc<BackendError>>> {
        self.eval_all(inputs, RowsWant::Greedy)
            .into_iter()
            .map(|r| match r {
                Ok(Out::Chosen(id)) => Ok(id),
                Ok(Out::Logits(l)) => Ok(ferrolm_engine::argmax(&l)),
                Ok(Out::Top(_)) => unreachable!("choices were asked for"),
                Err(e) => Err(Arc::new(e)),
            })
            .collect()
    }

    fn sample_on_device(
        &mut self,
        slot: usize,
        sampler: Option<&SamplerParams>,
    ) -> Result<bool, BackendError> {
        if slot != 0 {
            // Only the decode graph's slot chooses on the device.
            return Ok(false);
        }
        let Some(params) = sampler else {
            self.draws = None;
            self.gpu
                .set_sampling(None, &mut || 0.0)
                .map_err(device_error)?;
            return Ok(false);
        };
        let Ok(on_device) = device_sampling(params) else {
            return Ok(false);
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(params.seed);
        self.gpu
            .set_sampling(on_device, &mut || rng.random::<f32>())
            .map_err(device_error)?;
        self.draws = on_device.is_some().then_some(rng);
        Ok(true)
    }

    fn chosen(&mut self, slot: usize) -> Result<u32, BackendError> {
        one_slot(slot)?;
        self.gpu.greedy().map_err(device_error)
    }

    fn step_chosen(&mut self, slot: usize) -> Result<u32, BackendError> {
        one_slot(slot)?;
        self.ensure_draws().map_err(device_error)?;
        self.gpu.push_greedy_ahead().map_err(device_error)
    }

    fn expert_counts(&self) -> Option<Vec<Vec<u64>>> {
        self.with_expert_counts(<[Vec<u64>]>::to_vec)
    }

    fn expert_tier_stats(&self) -> Option<ferrolm_engine::ExpertTierStats> {
        self.with_expert_counts(|counts| self.gpu.expert_tiers(counts))
            .flatten()
    }

    fn decode_report(&self, tokens_per_s: f64, position: usize) -> Option<String> {
        let (now, before) = (self.gpu.stats(), self.since);
        let steps = (now.tokens - before.tokens).max(1) as f64;
        let plan = self.gpu.plan();
        let bytes = plan.weight_bytes_per_token() + plan.kv_bytes_at(position);
        let host = self.gpu.host_bytes_per_token();
        let over_bus = if host > 0 {
            format!(
                ", {:.1} MB of it from host memory ({:.1} GB/s over the bus)",
                host as f64 / 1e6,
                host as f64 * tokens_per_s / 1e9
            )
        } else {
            String::new()
        };
        Some(format!(
            "{:.1} MB read per token (weights {:.1} MB + KV at mid-run{over_bus}), {:.0} GB/s at {tokens_per_s:.1} tok/s; per token {:.2} graph launches ({} kernels each), {:.2} host syncs, {:.2} uploads",
            bytes as f64 / 1e6,
            plan.weight_bytes_per_token() as f64 / 1e6,
            bytes as f64 * tokens_per_s / 1e9,
            (now.graph_launches - before.graph_launches) as f64 / steps,
            plan.launches.len(),
            (now.host_syncs - before.host_syncs) as f64 / steps,
            (now.uploads - before.uploads) as f64 / steps,
        ))
    }
}

/// The first layers on the GPU and the rest with the output head on the CPU: each batch of ids
/// goes through the GPU's layers, their residual stream to the host, and on through the CPU
/// session's layers (`--gpu-layers`). One slot.
pub struct SplitBackend<'m> {
    gpu: CudaModel,
    /// The rest; its cache of the GPU's layers stays unused.
    cpu: Session<'m>,
    n_layers: usize,
}

impl Backend for SplitBackend<'_> {
    fn describe(&self) -> String {
        format!(
            "CUDA ({}) layers 0..{} of {} + CPU",
            self.gpu.device_name(),
            self.gpu.gpu_layers(),
            self.n_layers
        )
    }

    fn n_slots(&self) -> usize {
        1
    }

    fn n_ctx(&self) -> usize {
        self.cpu.n_ctx().min(self.gpu.n_ctx())
    }

    fn n_vocab(&self) -> usize {
        self.gpu.plan().n_vocab
    }

    fn position(&self, _slot: usize) -> usize {
        self.cpu.position()
    }

    fn truncate(&mut self, slot: usize, pos: usize) -> Result<usize, BackendError> {
        one_slot(slot)?;
        self.cpu.truncate(pos);
        self.gpu
            .truncate(self.cpu.position())
            .map_err(device_error)?;
        if self.gpu.position() != self.cpu.position() {
            // The GPU's recurrent layers start over where the CPU's could resume.
            self.cpu.reset();
        }
        Ok(self.cpu.position())
    }

    fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
        inputs
            .iter()
            .map(|input| {
                one_slot(input.slot)?;
                let hidden = self.gpu.eval_hidden(input.ids).map_err(device_error)?;
                Ok(self
                    .cpu
                    .eval_from(input.ids, self.gpu.gpu_layers(), &hidden, input.want)?)
            })
            .map(|r: Result<Vec<f32>, BackendError>| r.map_err(std::sync::Arc::new))
            .collect()
    }
}
