//! The CUDA backends behind ferrolm-engine's [`Backend`]: the whole model on one GPU
//! ([`CudaBackend`]), or its first layers there and the rest on the CPU ([`SplitBackend`],
//! `--gpu-layers`), and [`open`], which makes the one a configuration asks for.
//!
//! The device holds one sequence today (one KV cache fused with the weights): both backends
//! have one slot.

use ferrolm_engine::{Backend, BackendError, SamplerParams, SlotInput, SlotOutput};
use ferrolm_model::{Logits, Model, ModelError, Session};
use rand::{Rng, SeedableRng};

use crate::schedule::SAMPLE_MAX_K;
use crate::{CudaError, CudaModel, DeviceSampling, Stats};

/// What [`open`] makes.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// The CUDA device.
    pub ordinal: usize,
    /// Positions of the context.
    pub n_ctx: usize,
    /// Layers on the GPU, the rest and the output head on the CPU (`None` or at least the
    /// model's layer count: all of them).
    pub gpu_layers: Option<usize>,
}

/// The backend `options` ask for on `model`: the whole model on the GPU, or its first layers.
pub fn open<'m>(
    model: &'m Model,
    options: &CudaOptions,
) -> Result<Box<dyn Backend + 'm>, CudaError> {
    let layers = options.gpu_layers.unwrap_or(usize::MAX);
    let gpu = CudaModel::with_layers(
        model.plan(),
        model.file(),
        options.ordinal,
        options.n_ctx,
        layers,
    )?;
    if gpu.is_whole() {
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

/// The whole model on one GPU, one slot; each decode step one CUDA graph launch.
pub struct CudaBackend {
    gpu: CudaModel,
    /// The draws of device sampling (the host sampler's generator, seeded alike), while on.
    draws: Option<rand::rngs::StdRng>,
    /// The counters when the sequence last started, for [`Backend::decode_report`].
    since: Stats,
}

impl CudaBackend {
    /// The backend over a model already on the device.
    pub fn new(gpu: CudaModel) -> CudaBackend {
        let since = gpu.stats();
        CudaBackend {
            gpu,
            draws: None,
            since,
        }
    }

    /// The model on the device (`cuda-check` and profiling reach past the interface).
    pub fn model(&mut self) -> &mut CudaModel {
        &mut self.gpu
    }

    /// Before a step that may draw: the device's draws topped up.
    fn ensure_draws(&mut self) -> Result<(), CudaError> {
        if let Some(rng) = self.draws.as_mut() {
            self.gpu.ensure_draws(&mut || rng.random::<f32>())?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        format!("CUDA ({})", self.gpu.device_name())
    }

    fn n_slots(&self) -> usize {
        1
    }

    fn n_ctx(&self) -> usize {
        self.gpu.n_ctx()
    }

    fn n_vocab(&self) -> usize {
        self.gpu.plan().n_vocab
    }

    fn position(&self, _slot: usize) -> usize {
        self.gpu.position()
    }

    fn truncate(&mut self, slot: usize, pos: usize) -> Result<usize, BackendError> {
        one_slot(slot)?;
        self.gpu.truncate(pos).map_err(device_error)?;
        if pos == 0 {
            self.since = self.gpu.stats();
        }
        Ok(self.gpu.position())
    }

    fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
        inputs
            .iter()
            .map(|input| {
                one_slot(input.slot)?;
                self.ensure_draws().map_err(device_error)?;
                match input.want {
                    Logits::All => self.gpu.eval(input.ids, true),
                    Logits::Last => self.gpu.eval(input.ids, false),
                    Logits::None if input.ids.is_empty() => Ok(Vec::new()),
                    // The last logits are read anyway (the step ends with them).
                    Logits::None => self.gpu.eval(input.ids, false).map(|_| Vec::new()),
                }
                .map_err(device_error)
            })
            .map(|r| r.map_err(std::sync::Arc::new))
            .collect()
    }

    fn sample_on_device(
        &mut self,
        slot: usize,
        sampler: Option<&SamplerParams>,
    ) -> Result<bool, BackendError> {
        one_slot(slot)?;
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

    fn decode_report(&self, tokens_per_s: f64, position: usize) -> Option<String> {
        let (now, before) = (self.gpu.stats(), self.since);
        let steps = (now.tokens - before.tokens).max(1) as f64;
        let plan = self.gpu.plan();
        let bytes = plan.weight_bytes_per_token() + plan.kv_bytes_at(position);
        Some(format!(
            "{:.1} MB read per token (weights {:.1} MB + KV at mid-run), {:.0} GB/s at {tokens_per_s:.1} tok/s; per token {:.2} graph launches ({} kernels each), {:.2} host syncs, {:.2} uploads",
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
