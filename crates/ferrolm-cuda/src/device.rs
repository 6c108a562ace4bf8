//! The executor: weights uploaded once, buffers allocated once, the launch plan resolved to
//! addresses and captured into one CUDA graph that every token replays.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use ferrolm_model::Model;

use crate::cpu_tier::CpuTier;
use crate::kernels;
use crate::kv_pages::{KvPages, PagePool};
use crate::prefill::{self, Addresses, Prefill, RowsWant, MAX_BATCH};
use crate::schedule::{
    decode_plan_with, Arg, Buf, DecodePlan, SAMPLE_DRAWS, SAMPLE_MAX_K, TOKEN_RING,
};
use crate::tiers::Tier;
use crate::{CudaError, CudaTuning};

pub(crate) fn driver(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e}"))
}

/// The number of CUDA devices, or why CUDA cannot be used here (no driver library, no device).
/// Loads nothing when the driver library is absent.
pub fn device_count() -> Result<usize, CudaError> {
    // SAFETY: only tries to open the library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoCuda(
            "the CUDA driver library (libcuda.so) was not found".into(),
        ));
    }
    let n = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| CudaError::NoCuda("the CUDA driver could not be loaded".into()))?
        .map_err(|e| CudaError::NoCuda(format!("the CUDA driver reports {e}")))?;
    Ok(n.max(0) as usize)
}

/// A kernel argument with its value resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// A device address (0: none).
    Ptr(u64),
    /// An `int`.
    I32(i32),
    /// A `long long`.
    I64(i64),
    /// A `float`.
    F32(f32),
}

/// Launches `func` on `stream` with `args` (which must match the kernel's parameters).
pub(crate) fn launch(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Value],
) -> Result<(), CudaError> {
    let mut b = stream.launch_builder(func);
    for a in args {
        match a {
            Value::Ptr(p) => b.arg(p),
            Value::I32(v) => b.arg(v),
            Value::I64(v) => b.arg(v),
            Value::F32(v) => b.arg(v),
        };
    }
    // SAFETY: the arguments match the kernel's parameters as the launch plan (or the batched
    // pass) lists them, checked on the device by the logits comparison of `cuda-check`; the
    // buffers outlive the model.
    unsafe { b.launch(cfg) }.map_err(driver("launching a kernel"))?;
    Ok(())
}

/// Launches like [`launch`], but lets the driver schedule the kernel before the previous one on
/// the stream has finished (programmatic dependent launch, compute capability 9.0 and later; a
/// captured graph keeps the edge). The kernel waits for its predecessor itself (`step_begin` in
/// kernels.cu), so only its launch and its weight prefetch overlap the predecessor's work.
pub(crate) fn launch_overlapped(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Value],
) -> Result<(), CudaError> {
    let mut params: Vec<*mut std::ffi::c_void> = args
        .iter()
        .map(|a| match a {
            Value::Ptr(v) => v as *const u64 as *mut std::ffi::c_void,
            Value::I32(v) => v as *const i32 as *mut std::ffi::c_void,
            Value::I64(v) => v as *const i64 as *mut std::ffi::c_void,
            Value::F32(v) => v as *const f32 as *mut std::ffi::c_void,
        })
        .collect();
    // SAFETY: a plain C struct and union, all zeros is "no attribute"; both fields are set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    stream
        .context()
        .bind_to_thread()
        .map_err(driver("binding the context"))?;
    // SAFETY: as for `launch`: the arguments match the kernel's parameters (each pointer in
    // `params` points into `args`, alive for the call), the stream and function are alive.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(driver("launching a kernel"))?;
    Ok(())
}

struct Resolved {
    name: String,
    func: CudaFunction,
    cfg: LaunchConfig,
    args: Vec<Value>,
}

/// Each row's greedy choice and its largest values as (id, value) ([`CudaModel::select_rows`]).
pub type Selections = (Vec<u32>, Vec<Vec<(u32, f32)>>);

/// What a batched decode step ([`CudaModel::eval_rows`]) returns for its rows.
#[derive(Clone, Debug, PartialEq)]
pub enum Rows {
    /// Every row's logits, `n_vocab` each.
    Logits(Vec<f32>),
    /// Every row's greedy choice (the first largest logit).
    Greedy(Vec<u32>),
    /// Every row's largest logits as (id, logit), in no order.
    Top(Vec<Vec<(u32, f32)>>),
}

impl Rows {
    /// The logits (empty for choices or candidates).
    pub fn into_logits(self) -> Vec<f32> {
        match self {
            Rows::Logits(l) => l,
            Rows::Greedy(_) | Rows::Top(_) => Vec::new(),
        }
    }
}

/// Counters of what the device path did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Tokens evaluated.
    pub tokens: u64,
    /// Graph launches (or, without a graph, steps launched kernel by kernel).
    pub graph_launches: u64,
    /// Kernel launches made one by one (capture, or the no-graph mode).
    pub kernel_launches: u64,
    /// Host waits on the device (each device-to-host read is one).
    pub host_syncs: u64,
    /// Host-to-device copies (token ids, positions).
    pub uploads: u64,
    /// Prompt batches evaluated by the batched pass (GEMMs).
    pub batches: u64,
}

/// How the device draws tokens (the CPU sampler's settings it serves).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSampling {
    /// Keep the k most likely tokens (1 to [`SAMPLE_MAX_K`]).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities add up to p (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one (0: none).
    pub min_p: f32,
    /// Temperature (positive).
    pub temperature: f32,
}

/// The ids the steps chose, written by the device into page-locked host memory mapped into
/// its address space (`Buf::TokenRing`): the host reads one after waiting for its step's event
/// alone, so the next step can already be queued.
struct TokenRing {
    slots: PinnedHostSlice<u32>,
    /// `slots`' host address (kept as a number: the model stays `Send`).
    host: usize,
    /// Recorded after each step, one per slot.
    done: Vec<CudaEvent>,
    /// The slot of the last step launched, when that step wrote one (a prompt batch does not).
    last: Option<usize>,
}

impl TokenRing {
    fn new(ctx: &Arc<CudaContext>) -> Result<(TokenRing, u64), CudaError> {
        // (the slots are read only after a step has written them: `last`)
        let (slots, host, dev) = mapped_pinned::<u32>(ctx, TOKEN_RING, "the token ring")?;
        let done = (0..TOKEN_RING)
            .map(|_| ctx.new_event(None))
            .collect::<Result<Vec<_>, _>>()
            .map_err(driver("creating the token ring's events"))?;
        let ring = TokenRing {
            host: host as usize,
            slots,
            done,
            last: None,
        };
        Ok((ring, dev))
    }

    /// The id in `slot` once its step is done.
    fn read(&self, slot: usize) -> Result<u32, CudaError> {
        self.done[slot]
            .synchronize()
            .map_err(driver("reading the token"))?;
        debug_assert!(slot < self.slots.len());
        // SAFETY: `host` holds TOKEN_RING u32 for the ring's lifetime; the device wrote the
        // slot before the event completed (volatile: the device, not this thread, wrote it).
        Ok(unsafe { std::ptr::read_volatile((self.host as *const u32).add(slot)) })
    }
}

impl Drop for TokenRing {
    // The slots are freed after this: no step still queued may write them then.
    fn drop(&mut self) {
        for e in &self.done {
            let _ = e.synchronize();
        }
    }
}

/// `n` elements of pinned host memory mapped into the device's address space: the memory, its
/// host address and the address kernels read it at.
fn mapped_pinned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    n: usize,
    what: &str,
) -> Result<(cudarc::driver::PinnedHostSlice<T>, *mut T, u64), CudaError> {
    // SAFETY: the callers write the memory before anything reads it.
    let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<T>(n, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
        .map_err(driver(what))?;
    let host = pinned.as_mut_ptr().map_err(driver(what))?;
    let mut device: sys::CUdeviceptr = 0;
    // SAFETY: `host` was allocated by cuMemHostAlloc with DEVICEMAP in this context.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) }
        .result()
        .map_err(driver(what))?;
    Ok((pinned, host, device))
}

/// Page-locked host memory for the CPU tier's output rows in prompt batches.
struct PinnedRows(cudarc::driver::PinnedHostSlice<f32>);

impl crate::cpu_prompt::RowsMemory for PinnedRows {
    fn rows_mut(&mut self, len: usize) -> Result<&mut [f32], String> {
        let all = self.0.as_mut_slice().map_err(|e| e.to_string())?;
        let room = all.len();
        all.get_mut(..len)
            .ok_or_else(|| format!("{len} output values past the {room} pinned"))
    }

    fn rows(&self, len: usize) -> Result<&[f32], String> {
        let all = self.0.as_slice().map_err(|e| e.to_string())?;
        all.get(..len)
            .ok_or_else(|| format!("{len} output values past the {} pinned", all.len()))
    }
}

/// A weight matrix's memory: on the device, or pinned in host memory mapped for the device
/// (an expert stack a `--gpu-memory` budget leaves no room for: `tiers.rs`).
enum MatrixMemory {
    Device(CudaSlice<u8>),
    /// Not on the device nor in its reach: experts streamed from the file, which only the
    /// CPU tier reads.
    Absent,
    Host {
        // Held for the mapping's lifetime.
        _pinned: cudarc::driver::PinnedHostSlice<u8>,
        device: u64,
    },
}

impl MatrixMemory {
    /// `bytes` copied into pinned host memory the device reads through its mapping.
    fn mapped(ctx: &Arc<CudaContext>, bytes: &[u8], what: &str) -> Result<MatrixMemory, CudaError> {
        // (written here, before any kernel reads it)
        let (pinned, host, device) = mapped_pinned::<u8>(ctx, bytes.len().max(1), what)?;
        // SAFETY: `host` holds at least `bytes.len()` bytes, allocated above.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host, bytes.len()) };
        Ok(MatrixMemory::Host {
            _pinned: pinned,
            device,
        })
    }

    /// The address the kernels read it at.
    fn address(&self, stream: &CudaStream) -> u64 {
        match self {
            MatrixMemory::Device(s) => s.device_ptr(stream).0,
            MatrixMemory::Host { device, .. } => *device,
            MatrixMemory::Absent => 0,
        }
    }
}

/// The CPU tier's worker and the exchange it answers in: the stream synchronized before the
/// worker stops (no step still waits for an answer), the worker stopped before the exchange is
/// freed.
struct CpuTierHold {
    stream: Arc<CudaStream>,
    worker: Option<CpuTier>,
    _exchange: cudarc::driver::PinnedHostSlice<u8>,
}

impl Drop for CpuTierHold {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        self.worker.take();
    }
}

/// A model on one GPU, decoding one sequence a token at a time.
pub struct CudaModel {
    /// The CPU's share of the experts in layers left in host memory (first: dropped first).
    cpu_tier: Option<CpuTierHold>,
    /// The expert slot cache (`--gpu-memory` with `CudaTuning::expert_slots`).
    expert_slots: Option<crate::slots::DeviceSlots>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    plan: DecodePlan,
    launches: Vec<Resolved>,
    graph: Option<CudaGraph>,
    /// The batched prompt pass (`None` without cuBLAS: prompts run as decode steps).
    prefill: Option<Prefill>,
    /// Device addresses of the matrices, vectors and caches, for the batched pass.
    matrix_addrs: Vec<u64>,
    vector_addrs: Vec<u64>,
    k_cache: Vec<u64>,
    v_cache: Vec<u64>,
    /// Which of `_buffers` holds each symbolic buffer.
    buf_index: HashMap<Buf, usize>,
    /// Draws the device has used of those it holds, when it samples.
    draws_used: Option<usize>,
    // Held for their addresses, which `launches` and the graph use.
    _matrices: Vec<MatrixMemory>,
    /// Where each matrix lives (`--gpu-memory`).
    tiers: Vec<Tier>,
    _vectors: Vec<CudaSlice<f32>>,
    _buffers: Vec<CudaSlice<u8>>,
    logits: CudaSlice<f32>,
    token: CudaSlice<u32>,
    pos_buf: CudaSlice<u32>,
    /// Present when the step chooses a token (the whole model).
    ring: Option<TokenRing>,
    /// Slot 0's position (the decode graph's sequence).
    pos: usize,
    /// Sequences the caches hold; slot s of layer l starts `slot_stride[l]` halfs after s - 1.
    slots: usize,
    slot_stride: Vec<usize>,
    /// The caches' memory mapped in pages as slots grow (several slots): `None`, allocated
    /// whole.
    pages: Option<KvPages>,
    /// Slots whose caches a step's room took ([`CudaModel::take_evicted`]).
    evicted: Vec<usize>,
    /// The logits and choice of other slots' prompts (slot 0's are the graph's).
    rows_logits: CudaSlice<f32>,
    rows_token: CudaSlice<u32>,
    name: String,
    /// Whether the step's kernels are launched to overlap their predecessors (compute
    /// capability 9.0 and later, unless the tuning says otherwise).
    overlap: bool,
    stats: Stats,
    /// A model with recurrent layers: their states as they were at the end of the last prompt
    /// (the position, copies of the state buffers in layer order), so that going back to a
    /// position at or after it (a chat's next turn) resumes there instead of starting over.
    checkpoint: Option<(usize, Vec<CudaSlice<u8>>)>,
}

/// Bytes each symbolic buffer needs, with caches for `slots` sequences.
fn buffer_bytes(p: &DecodePlan, b: Buf, slots: usize) -> usize {
    4 * match b {
        Buf::X | Buf::H => p.n_embd,
        Buf::Q | Buf::AttnGate => p.max_q,
        Buf::Attn => p.max_attn,
        Buf::DeltaIn => p.delta.input,
        Buf::DeltaZ => p.delta.z,
        Buf::DeltaBa => p.delta.gates,
        Buf::DeltaAlpha => p.delta.alpha,
        Buf::DeltaConv => p.delta.channels,
        Buf::DeltaOut => p.delta.value,
        Buf::ExpertCounts(l) => p.layers[l].moe.as_ref().map_or(0, |m| m.n_expert),
        // A slot's states after another's, as the caches (and the spare slot's).
        Buf::ConvState(l) | Buf::SsmState(l) => {
            let slots = if slots > 1 { slots + 1 } else { 1 };
            slots * p.layers[l].state_floats()[usize::from(b == Buf::SsmState(l))]
        }
        Buf::K | Buf::V => p.max_kv,
        Buf::Gate | Buf::Up | Buf::Act => p.max_ff,
        Buf::PartO => p.max_part,
        // (an f32 router's runs of columns in moe_route_f32 each have a row of their own)
        Buf::Router => p.max_experts * crate::schedule::ROUTER_MOST_PARTS,
        Buf::ExpertIds | Buf::ExpertWeights => p.max_used,
        Buf::ExpertOut => p.max_used * p.n_embd,
        Buf::SharedOut => p.n_embd,
        Buf::SharedGate => 1,
        Buf::PartMl => 2 * p.max_heads_splits,
        Buf::Done => p.max_heads_splits,
        Buf::SampleCfg => 8,
        Buf::Draws => SAMPLE_DRAWS,
        Buf::DrawIdx => 1,
        // int8 values, then two floats per 32 values, in whole 16-byte words
        Buf::Xq => {
            let w = p.n_embd.max(p.max_q).max(p.max_ff);
            (w + w / 4).div_ceil(16) * 4
        }
        // Several slots have one more, where a batched step's padding rows write.
        Buf::KCache(l) | Buf::VCache(l) => {
            let slots = if slots > 1 { slots + 1 } else { 1 };
            slots * p.n_ctx * p.kv_dims[l] / 2
        }
        Buf::CpuSeq => p.layers.len(),
        Buf::ExpertTable(l) => 6 * p.layers[l].moe.as_ref().map_or(0, |m| m.n_expert),
        Buf::ExpertStage(i) => p
            .staged_experts
            .as_ref()
            .map_or(0, |s| s.stage_bytes[i] / 4),
        Buf::SlotIds => p.max_used,
        Buf::Matrix(_)
        | Buf::Vector(_)
        | Buf::Logits
        | Buf::Token
        | Buf::Pos
        | Buf::TokenRing
        | Buf::CpuExchange => 0,
    }
}

impl CudaModel {
    /// Uploads `model`'s bound weights ([`Model::weights`]: the CPU's own, from its file) to
    /// GPU `ordinal`, with a KV cache of `n_ctx` positions, compiles (or loads from the cache)
    /// the kernels and captures the decode step.
    pub fn new(model: &Model, ordinal: usize, n_ctx: usize) -> Result<CudaModel, CudaError> {
        CudaModel::with_layers(model, ordinal, n_ctx, usize::MAX)
    }

    /// [`CudaModel::new`] as `tuning` says (its switches and sizes, to compare variants).
    pub fn with_tuning(
        model: &Model,
        ordinal: usize,
        n_ctx: usize,
        tuning: &CudaTuning,
    ) -> Result<CudaModel, CudaError> {
        CudaModel::with_slots(model, ordinal, n_ctx, usize::MAX, 1, tuning)
    }

    /// [`CudaModel::new`] for the first `gpu_layers` layers only (`--gpu-layers`): the device
    /// holds their weights and cache and the embedding, and [`CudaModel::eval_hidden`] returns
    /// the residual stream they leave for the CPU's layers and output head. As many layers as
    /// the model has, or more: the whole model.
    pub fn with_layers(
        model: &Model,
        ordinal: usize,
        n_ctx: usize,
        gpu_layers: usize,
    ) -> Result<CudaModel, CudaError> {
        CudaModel::with_slots(model, ordinal, n_ctx, gpu_layers, 1, &CudaTuning::default())
    }

    /// [`CudaModel::with_layers`] with caches for `slots` sequences (at least 1): slot 0 is
    /// the one the decode graph serves; every slot takes prompts ([`CudaModel::eval_slot`])
    /// and batched decode steps ([`CudaModel::eval_rows`]). With more than one slot (and
    /// cuBLAS), every quantized matrix is also kept as f16 where memory allows, for the GEMMs
    /// of batched steps. More than one slot needs the whole model and cuBLAS.
    pub fn with_slots(
        model: &Model,
        ordinal: usize,
        n_ctx: usize,
        gpu_layers: usize,
        slots: usize,
        tuning: &CudaTuning,
    ) -> Result<CudaModel, CudaError> {
        let slots = slots.max(1);
        // The plan first: a model the path declines says so (and runs on the CPU) wherever it
        // is, with or without CUDA.
        let (plan, file) = (model.plan(), model.file());
        let dp = decode_plan_with(plan, model.weights(), n_ctx, gpu_layers, tuning)
            .map_err(CudaError::Declined)?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoCuda(format!(
                "CUDA device {ordinal} asked for, {count} present"
            )));
        }
        // SAFETY: nvrtc is only used after this check found its library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::NoCuda(
                "the NVRTC library (libnvrtc.so) was not found".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("creating the context"))?;
        // SAFETY: one stream orders everything this model does; no buffer is shared across
        // streams. Event tracking recorded inside a graph capture breaks the next launch.
        unsafe { ctx.disable_event_tracking() };
        // Capture is not allowed on the legacy default stream: a stream of our own.
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let module = load_module(&ctx, major, minor, tuning)?;
        // Bulk copies into shared memory need compute capability 9.0.
        let dp = if major >= 9 { dp } else { dp.unstaged() };

        let pool = if slots > 1 && tuning.paged_kv {
            let (free, _) = ctx.mem_get_info().map_err(driver("reading free memory"))?;
            PagePool::plan(&dp, &ctx, ordinal, slots, tuning, free as u64)?
        } else {
            None
        };
        let caches = match &pool {
            Some(p) => p.device_bytes() + (slots + 1) as u64 * dp.state_bytes(),
            None => (if slots > 1 { slots + 1 } else { 1 }) as u64 * dp.kv_bytes_total(),
        };
        let fixed = caches + prefill::scratch_bytes(&dp);
        // Experts streamed from the file (the model larger than host memory): the stacks left
        // off the device are not copied to host memory; the CPU computes every chosen expert
        // of their layers, reading them through the model's expert cache.
        let streamed = model.expert_cache_stats().is_some();
        if streamed && tuning.expert_slots {
            return Err(CudaError::Model(
                "the expert slot cache copies experts from host memory, and this model's are \
                 streamed from the file (--expert-cache): drop one"
                    .into(),
            ));
        }
        // Under a budget, the expert stacks it leaves no room for stay in host memory.
        // (with the slot cache, every stack there, and what is left as slots)
        let slot_room = match tuning.gpu_memory {
            Some(budget) if tuning.expert_slots => {
                Some(crate::tiers::room_for_experts(&dp, fixed, budget)?)
            }
            _ => None,
        };
        let tiers = match slot_room {
            Some(_) => crate::tiers::stacks_on_host(&dp),
            None if streamed => {
                crate::tiers::whole_layers(&dp, crate::tiers::place(&dp, fixed, tuning.gpu_memory)?)
            }
            None => crate::tiers::place(&dp, fixed, tuning.gpu_memory)?,
        };
        let on_device: u64 = dp
            .matrices
            .iter()
            .zip(&tiers)
            .filter(|(_, &t)| t == Tier::Device)
            .map(|(m, _)| m.total_bytes())
            .sum();
        let dp = dp.unstaged_where(|m| tiers[m] == Tier::Host);
        // The CPU's share of the chosen experts in the layers left wholly in host memory.
        let cpu_layers = crate::tiers::host_layers(&dp, &tiers);
        let slotted = if slot_room.is_some() {
            &cpu_layers[..]
        } else {
            &[]
        };
        let dp = dp.with_expert_slots(slotted)?;
        // Slots for as many experts a layer as the room left after the stages allows.
        let per_layer = match (&dp.staged_experts, slot_room) {
            (Some(staged), Some(room)) => {
                let room = room.saturating_sub(staged.stage_bytes.iter().sum::<usize>() as u64);
                let one = crate::slots::slot_bytes(&dp, staged, 1).max(1);
                (room / one) as usize
            }
            _ => 0,
        };
        let need = on_device + fixed;
        let (free, _) = ctx.mem_get_info().map_err(driver("reading free memory"))?;
        if need as usize > free {
            return Err(CudaError::OutOfMemory {
                needed: need,
                free: free as u64,
            });
        }

        let mut matrices = Vec::with_capacity(dp.matrices.len());
        for (m, &tier) in dp.matrices.iter().zip(&tiers) {
            // (the bound matrix's bytes in the file, as the CPU reads them)
            let Some(data) = m.bytes(file.file_bytes()) else {
                return Err(CudaError::Model(format!(
                    "{}: bytes {:?} of the file, rows {}..{} of {} bytes, past its {} bytes",
                    m.label,
                    m.tensor,
                    m.first_row,
                    m.first_row + m.rows,
                    m.row_bytes(),
                    file.file_bytes().len()
                )));
            };
            // Regrouped for aligned loads where the plan's kernels read a regrouped layout.
            let packed = m
                .repacked()
                .then(|| crate::repack::repack(m.ty, m.cols, &data))
                .flatten();
            let bytes = packed.as_deref().unwrap_or(&data);
            matrices.push(match tier {
                Tier::Device => {
                    MatrixMemory::Device(stream.clone_htod(bytes).map_err(driver(&m.label))?)
                }
                // (read only by the CPU, through the model's cache)
                Tier::Host if streamed => MatrixMemory::Absent,
                Tier::Host => MatrixMemory::mapped(&ctx, bytes, &m.label)?,
            });
        }
        // The CPU tier: as many experts a layer as asked, or as timing both sides chooses.
        let tier_threads = match tuning.cpu_tier_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
            n => n,
        };
        // The CPU tier's count in each such layer: as asked (at most k - 1), every chosen
        // expert where they are streamed, or timed once for each kind of layer (its stacks'
        // types and sizes, k) with `--cpu-experts auto`.
        let mut counts = Vec::with_capacity(cpu_layers.len());
        let mut timed = HashMap::new();
        for &l in &cpu_layers {
            let moe = dp.layers[l].moe.as_ref().expect("a layer of experts");
            let k = moe.n_used;
            let kind = (
                moe.experts
                    .map(|m| (dp.matrices[m].kernel, dp.matrices[m].expert_bytes())),
                k,
            );
            if streamed {
                counts.push((l, k));
                continue;
            }
            let asked = match timed.get(&kind) {
                Some(&c) => c,
                None if tuning.cpu_experts_auto => {
                    let stacks = moe.experts.map(|m| matrices[m].address(&stream));
                    let experts = model
                        .host_experts(&[l])
                        .map_err(|e| CudaError::Model(e.to_string()))?;
                    let chosen = crate::cpu_tier::calibrate(
                        &stream,
                        &module,
                        &dp,
                        l,
                        stacks,
                        &experts,
                        tier_threads,
                    )?
                    .unwrap_or(tuning.cpu_experts);
                    *timed.entry(kind).or_insert(chosen)
                }
                None => tuning.cpu_experts,
            };
            counts.push((l, asked.min(k.saturating_sub(1))));
        }
        let dp = dp.with_cpu_experts_each(&counts)?;
        let mut vectors = Vec::with_capacity(dp.vectors.len());
        for v in &dp.vectors {
            // (the bound values, read into f32 once by the binding)
            vectors.push(stream.clone_htod(&v.values[..]).map_err(driver(&v.label))?);
        }
        let logits = stream
            .alloc_zeros::<f32>(dp.n_vocab)
            .map_err(driver("logits"))?;
        let token = stream.alloc_zeros::<u32>(1).map_err(driver("token"))?;
        let pos_buf = stream.alloc_zeros::<u32>(1).map_err(driver("position"))?;

        let pages = match &pool {
            Some(p) => Some(KvPages::new(&ctx, &stream, ordinal, p, dp.n_ctx, slots)?),
            None => None,
        };
        // Every other buffer the launches name, allocated once (zeroed: the caches too).
        let mut buffers = Vec::new();
        let mut ring = None;
        let mut exchange = None;
        let mut buf_index: HashMap<Buf, usize> = HashMap::new();
        let mut addr: HashMap<Buf, u64> = HashMap::new();
        let ptr = |s: &CudaSlice<u8>| s.device_ptr(&stream).0;
        for l in &dp.launches {
            for a in &l.args {
                if let Arg::Buf(b) = *a {
                    if addr.contains_key(&b) {
                        continue;
                    }
                    let p = match b {
                        Buf::Matrix(i) => matrices[i].address(&stream),
                        Buf::Vector(i) => vectors[i].device_ptr(&stream).0,
                        Buf::Logits => logits.device_ptr(&stream).0,
                        Buf::Token => token.device_ptr(&stream).0,
                        Buf::Pos => pos_buf.device_ptr(&stream).0,
                        Buf::TokenRing => {
                            let (r, dev) = TokenRing::new(&ctx)?;
                            ring = Some(r);
                            dev
                        }
                        Buf::CpuExchange => {
                            let bytes = dp.cpu_experts.as_ref().map_or(0, |c| c.exchange_bytes());
                            let (pinned, host, dev) = mapped_pinned::<u8>(
                                &ctx,
                                bytes.max(256),
                                "the CPU tier's exchange",
                            )?;
                            // SAFETY: `host` holds `bytes` (at least 256) bytes, allocated above;
                            // the flags start at zero (no step published, none answered).
                            unsafe { std::ptr::write_bytes(host, 0, bytes.max(256)) };
                            exchange = Some((pinned, host));
                            dev
                        }
                        Buf::KCache(l) | Buf::VCache(l) if pages.is_some() => {
                            let values = matches!(b, Buf::VCache(_));
                            pages.as_ref().expect("checked").cache(l, values)
                        }
                        _ => {
                            let s = stream
                                .alloc_zeros::<u8>(buffer_bytes(&dp, b, slots).max(16))
                                .map_err(driver("activations"))?;
                            let p = ptr(&s);
                            buf_index.insert(b, buffers.len());
                            buffers.push(s);
                            p
                        }
                    };
                    addr.insert(b, p);
                }
            }
        }
        let mut funcs: HashMap<&str, CudaFunction> = HashMap::new();
        let mut launches = Vec::with_capacity(dp.launches.len());
        for l in &dp.launches {
            let func = match funcs.get(l.kernel.as_str()) {
                Some(f) => f.clone(),
                None => {
                    let f = module.load_function(&l.kernel).map_err(driver(&l.kernel))?;
                    funcs.insert(&l.kernel, f.clone());
                    f
                }
            };
            let args = l
                .args
                .iter()
                .map(|a| match *a {
                    Arg::Buf(b) => Value::Ptr(addr[&b]),
                    Arg::Null => Value::Ptr(0),
                    Arg::I32(v) => Value::I32(v),
                    Arg::F32(v) => Value::F32(v),
                    Arg::I64(v) => Value::I64(v),
                })
                .collect();
            launches.push(Resolved {
                name: l.kernel.clone(),
                func,
                cfg: LaunchConfig {
                    grid_dim: (l.grid.0, l.grid.1, 1),
                    block_dim: (l.block, 1, 1),
                    shared_mem_bytes: l.shared,
                },
                args,
            });
        }
        let mut prefill = if tuning.batched_prompts {
            Prefill::new(&stream, &module, &dp, tuning, major >= 9)?
        } else {
            None
        };
        // The CPU's share of the same layers' expert groups in prompt batches.
        if let (Some(prefill), false) = (prefill.as_mut(), cpu_layers.is_empty()) {
            let fewest_experts = (cpu_layers.iter())
                .filter_map(|&l| dp.layers[l].moe.as_ref().map(|m| m.n_expert))
                .min()
                .unwrap_or(0);
            let (count, adapt) = match tuning.prompt_cpu_experts {
                // (streamed: the CPU alone reads those layers' experts)
                _ if streamed => (usize::MAX, false),
                Some(c) => (c, false),
                None => (fewest_experts * 3 / 8, true),
            };
            if count > 0 {
                let experts = model
                    .host_experts(&cpu_layers)
                    .map_err(|e| CudaError::Model(e.to_string()))?;
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                let threads = tier_threads.max(cores.saturating_sub(2));
                let mut share =
                    crate::cpu_prompt::PromptCpuShare::new(experts, threads, count, adapt)?;
                // (a batch's every pair at most, twice that with the groups padded)
                let most = 2 * MAX_BATCH * dp.max_used * dp.n_embd;
                // SAFETY: the CPU writes rows before the copies read them.
                let pinned = unsafe { ctx.alloc_pinned::<f32>(most) }
                    .map_err(driver("the CPU tier's prompt rows"))?;
                share.set_rows_memory(Box::new(PinnedRows(pinned)));
                prefill.set_cpu_share(share);
            }
        }
        let matrix_addrs = matrices.iter().map(|m| m.address(&stream)).collect();
        let vector_addrs = vectors.iter().map(|v| v.device_ptr(&stream).0).collect();
        let cache = |f: fn(usize) -> Buf| -> Vec<u64> {
            (0..dp.layers.len())
                .map(|l| addr.get(&f(l)).copied().unwrap_or(0))
                .collect()
        };
        let (k_cache, v_cache) = (cache(Buf::KCache), cache(Buf::VCache));
        let slot_stride = match &pages {
            Some(pages) => (0..dp.layers.len()).map(|l| pages.slot_stride(l)).collect(),
            None => dp.kv_dims.iter().map(|&kv| dp.n_ctx * kv).collect(),
        };
        let rows_logits = stream
            .alloc_zeros::<f32>(dp.n_vocab)
            .map_err(driver("logits"))?;
        let rows_token = stream.alloc_zeros::<u32>(1).map_err(driver("token"))?;
        stream.synchronize().map_err(driver("uploading"))?;
        let cpu_tier = match (&dp.cpu_experts, exchange) {
            (Some(tier), Some((pinned, host))) => {
                let experts = model
                    .host_experts(&tier.layers)
                    .map_err(|e| CudaError::Model(e.to_string()))?;
                // SAFETY: `host` is the exchange's memory, which the hold frees after the
                // worker has stopped.
                let worker = unsafe { CpuTier::start(experts, tier, host, tier_threads)? };
                Some(CpuTierHold {
                    stream: stream.clone(),
                    worker: Some(worker),
                    _exchange: pinned,
                })
            }
            _ => None,
        };
        let mut model = CudaModel {
            cpu_tier,
            expert_slots: None,
            ctx,
            stream,
            plan: dp,
            launches,
            graph: None,
            prefill,
            matrix_addrs,
            vector_addrs,
            k_cache,
            v_cache,
            buf_index,
            draws_used: None,
            _matrices: matrices,
            tiers,
            _vectors: vectors,
            _buffers: buffers,
            logits,
            token,
            pos_buf,
            ring,
            pos: 0,
            slots,
            slot_stride,
            pages,
            evicted: Vec::new(),
            rows_logits,
            rows_token,
            name,
            overlap: major >= 9 && tuning.overlap,
            stats: Stats::default(),
            checkpoint: None,
        };
        if model.plan.staged_experts.is_some() {
            let slots = crate::slots::DeviceSlots::new(
                &model.stream,
                &model.plan,
                &model.matrix_addrs,
                per_layer,
                tuning.slot_interval,
            )?;
            let ids: Vec<u8> = (0..model.plan.max_used as u32)
                .flat_map(u32::to_le_bytes)
                .collect();
            model.write_buf(Buf::SlotIds, &ids)?;
            for (b, table) in slots.tables(&model.stream) {
                model.write_buf(b, &table)?;
            }
            model.expert_slots = Some(slots);
        }
        if tuning.graphs {
            model.capture()?;
        }
        if slots > 1 && (model.prefill.is_none() || !model.is_whole()) {
            return Err(CudaError::Model(
                "more than one sequence on the GPU needs the batched pass (the whole model \
                 there, cuBLAS)"
                    .into(),
            ));
        }
        // f16 copies of the weights for the batched passes' GEMMs (prompts and batched steps),
        // then of the expert stacks (prompts), each where it fits with an eighth of the device
        // to spare and no budget says otherwise; else each batch dequantizes what it reads.
        // The stacks' copies go in layer order as far as the room goes (all of a large MoE's
        // do not fit an 80 GB device beside its weights).
        if model.is_whole() && tuning.gpu_memory.is_none() {
            let at = model.addresses(0);
            for experts in [false, true] {
                let (on, want) = if experts {
                    (tuning.f16_experts, Prefill::f16_expert_bytes(&model.plan))
                } else {
                    (tuning.f16_weights, Prefill::f16_weight_bytes(&model.plan))
                };
                let (free, total) = model
                    .ctx
                    .mem_get_info()
                    .map_err(driver("reading free memory"))?;
                let spare = (2u64 << 30).max(total as u64 / 8);
                // The paged caches' pool comes first: the room it will map stays free.
                let pool = model.pages.as_ref().map_or(0, |p| p.unmade_bytes());
                let room = (free as u64).saturating_sub(spare + pool);
                if !on || want == 0 || (!experts && want >= room) {
                    continue;
                }
                let Some(p) = model.prefill.as_mut() else {
                    break;
                };
                if experts {
                    p.keep_f16_experts_within(&model.plan, &at, room)?;
                } else {
                    p.keep_f16_weights(&model.plan, &at)?;
                }
                model
                    .stream
                    .synchronize()
                    .map_err(driver("f16 copies of the weights"))?;
            }
        }
        Ok(model)
    }

    /// The device addresses the batched passes read and write, with `slot`'s caches (and,
    /// for a slot other than 0, its own logits and token buffers).
    fn addresses(&self, slot: usize) -> Addresses {
        let offset = |base: &[u64]| -> Vec<u64> {
            base.iter()
                .zip(&self.slot_stride)
                .map(|(&b, &stride)| b + (2 * slot * stride) as u64)
                .collect()
        };
        let (logits, token) = if slot == 0 {
            (&self.logits, &self.token)
        } else {
            (&self.rows_logits, &self.rows_token)
        };
        Addresses {
            matrices: self.matrix_addrs.clone(),
            vectors: self.vector_addrs.clone(),
            k_cache: offset(&self.k_cache),
            v_cache: offset(&self.v_cache),
            states: (0..self.plan.layers.len())
                .map(|l| {
                    let floats = self.plan.layers[l].state_floats();
                    [0, 1].map(|i| {
                        let b = [Buf::ConvState(l), Buf::SsmState(l)][i];
                        self.buf_index.get(&b).map_or(0, |&k| {
                            self._buffers[k].device_ptr(&self.stream).0
                                + (4 * slot * floats[i]) as u64
                        })
                    })
                })
                .collect(),
            expert_counts: (0..self.plan.layers.len())
                .map(|l| {
                    self.buf_index
                        .get(&Buf::ExpertCounts(l))
                        .map_or(0, |&i| self._buffers[i].device_ptr(&self.stream).0)
                })
                .collect(),
            logits: logits.device_ptr(&self.stream).0,
            token: token.device_ptr(&self.stream).0,
            sampling: [Buf::SampleCfg, Buf::Draws, Buf::DrawIdx].map(|b| {
                self.buf_index
                    .get(&b)
                    .map_or(0, |&i| self._buffers[i].device_ptr(&self.stream).0)
            }),
        }
    }

    /// The batched step's selections over rows of values the host gives (`n_vocab` each, at
    /// most 512 rows): each row's greedy choice and its `k` largest as (id, value), unsorted.
    /// For checks: the host's selections over the same values must be the same.
    pub fn select_rows(&mut self, rows: &[f32], k: usize) -> Result<Selections, CudaError> {
        let n_vocab = self.plan.n_vocab;
        if !rows.len().is_multiple_of(n_vocab) || rows.len() / n_vocab > MAX_BATCH {
            return Err(CudaError::Model(format!(
                "{} values are not whole rows of {n_vocab} (at most {MAX_BATCH})",
                rows.len()
            )));
        }
        let prefill = self
            .prefill
            .as_mut()
            .ok_or_else(|| CudaError::Model("selections need cuBLAS's batched passes".into()))?;
        prefill.select_rows(&self.plan, rows, k)
    }

    /// Sequences the caches hold.
    pub fn n_slots(&self) -> usize {
        self.slots
    }

    /// Room for `slot` to hold `positions` positions, set aside until [`CudaModel::release`]:
    /// `Ok(false)` when other slots' requests hold the paged caches' pool now. The idle slots
    /// whose caches it took are kept for [`CudaModel::take_evicted`] (their positions fall to
    /// 0: slot 0's here, the others' are the caller's to reset). Caches allocated whole always
    /// have room.
    pub fn reserve(&mut self, slot: usize, positions: usize) -> Result<bool, CudaError> {
        let Some(pages) = self.pages.as_mut() else {
            return Ok(true);
        };
        let before = self.evicted.len();
        if !pages.reserve(slot, positions.min(self.plan.n_ctx), &mut self.evicted)? {
            return Ok(false);
        }
        if self.evicted[before..].contains(&0) {
            self.truncate(0)?;
        }
        Ok(true)
    }

    /// [`CudaModel::reserve`], with no room an error: before a step writes there, for a
    /// caller that did not set the room aside.
    pub fn ensure_room(&mut self, slot: usize, positions: usize) -> Result<(), CudaError> {
        if self.reserve(slot, positions)? {
            return Ok(());
        }
        Err(CudaError::Model(format!(
            "no room in the KV cache pool ({} MB, --kv-memory) for slot {slot} to reach \
             position {positions}: other sequences hold it",
            self.kv_pool_bytes().unwrap_or(0) >> 20
        )))
    }

    /// The slots whose caches were given to others since the last call (their positions are
    /// 0 now; slot 0's already is).
    pub fn take_evicted(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.evicted)
    }

    /// `slot`'s request has ended: the room it set aside may go to other slots, and its cache
    /// stays until one needs it.
    pub fn release(&mut self, slot: usize) {
        if let Some(pages) = self.pages.as_mut() {
            pages.release(slot);
        }
    }

    /// Bytes of the paged caches' pool (`None`: caches allocated whole).
    pub fn kv_pool_bytes(&self) -> Option<u64> {
        self.pages.as_ref().map(KvPages::capacity_bytes)
    }

    /// Evaluates `ids` in `slot` from position `pos0` on (what the slot holds up to there
    /// stays; the caller tracks the slots' positions, slot 0's is [`CudaModel::position`])
    /// and returns every position's logits (`all`) or the last one's. Slot 0 takes the decode
    /// graph's path ([`CudaModel::eval`]); another slot takes the batched passes.
    pub fn eval_slot(
        &mut self,
        slot: usize,
        pos0: usize,
        ids: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, CudaError> {
        if slot == 0 {
            self.truncate(pos0)?;
            return self.eval(ids, all);
        }
        self.check_slot(slot, pos0, ids)?;
        self.ensure_room(slot, pos0 + ids.len())?;
        if ids.len() == 1 {
            let out = self.eval_rows(ids, &[slot as u32], &[pos0 as u32], RowsWant::Logits)?;
            return Ok(out.into_logits());
        }
        let at = self.addresses(slot);
        let prefill = self.prefill.as_mut().expect("checked by check_slot");
        let n_batches = ids.len().div_ceil(MAX_BATCH);
        let mut out = Vec::new();
        for (i, batch) in ids.chunks(MAX_BATCH).enumerate() {
            let last = i + 1 == n_batches;
            let pos = pos0 + i * MAX_BATCH;
            out.extend(prefill.eval(&self.plan, &at, batch, pos, all, last)?);
            self.stats.tokens += batch.len() as u64;
            self.stats.batches += 1;
        }
        if all {
            return Ok(out);
        }
        let mut last = vec![0f32; self.plan.n_vocab];
        self.stream
            .memcpy_dtoh(&self.rows_logits, &mut last)
            .map_err(driver("reading the logits"))?;
        self.stream
            .synchronize()
            .map_err(driver("reading the logits"))?;
        self.stats.host_syncs += 1;
        Ok(last)
    }

    fn check_slot(&self, slot: usize, pos0: usize, ids: &[u32]) -> Result<(), CudaError> {
        if slot >= self.slots || self.prefill.is_none() {
            return Err(CudaError::Model(format!(
                "slot {slot} asked for, the device holds {}",
                self.slots
            )));
        }
        self.check_at(pos0, ids)
    }

    /// One decode step of several sequences: `ids[t]` of slot `slots[t]` at position
    /// `pos[t]` (each slot at most once; slot 0 at its [`CudaModel::position`]), every weight
    /// read once for all of them. Returns what `want` asks of every row.
    pub fn eval_rows(
        &mut self,
        ids: &[u32],
        slots: &[u32],
        pos: &[u32],
        want: RowsWant,
    ) -> Result<Rows, CudaError> {
        if ids.len() != slots.len() || ids.len() != pos.len() || ids.len() > MAX_BATCH {
            return Err(CudaError::Model(format!(
                "a batched step of {} ids, {} slots and {} positions (at most {MAX_BATCH})",
                ids.len(),
                slots.len(),
                pos.len()
            )));
        }
        let mut seen = vec![false; self.slots];
        for ((&id, &slot), &p) in ids.iter().zip(slots).zip(pos) {
            let slot = slot as usize;
            self.check_slot(slot, p as usize, &[id])?;
            if std::mem::replace(&mut seen[slot], true) {
                return Err(CudaError::Model(format!("slot {slot} twice in one step")));
            }
            if slot == 0 && p as usize != self.pos {
                return Err(CudaError::Model(format!(
                    "slot 0 is at position {}, not {p}",
                    self.pos
                )));
            }
        }
        for (&slot, &p) in slots.iter().zip(pos) {
            self.ensure_room(slot as usize, p as usize + 1)?;
        }
        let at = self.addresses(0);
        let spare = self.slots as u32;
        let prefill = self.prefill.as_mut().expect("checked by check_slot");
        let out = prefill.decode_rows(
            &self.plan,
            &at,
            ids,
            slots,
            pos,
            &self.slot_stride,
            spare,
            want,
        )?;
        self.stats.tokens += ids.len() as u64;
        self.stats.batches += 1;
        self.stats.host_syncs += 1;
        if seen.first() == Some(&true) {
            // Slot 0 moved on outside the graph: its position follows, and the token ring's
            // last choice is no longer the next token.
            self.pos += 1;
            let at = [self.pos as u32];
            self.stream
                .memcpy_htod(&at, &mut self.pos_buf)
                .map_err(driver("setting the position"))?;
            self.stats.uploads += 1;
            if let Some(ring) = self.ring.as_mut() {
                ring.last = None;
            }
        }
        Ok(out)
    }

    fn launch_one(&self, r: &Resolved) -> Result<(), CudaError> {
        launch(&self.stream, &r.func, r.cfg, &r.args)
    }

    /// Launches the step's kernels in order, each overlapping the previous where the device
    /// allows it (`overlap`).
    fn launch_all(&mut self) -> Result<(), CudaError> {
        for r in &self.launches {
            if self.overlap {
                launch_overlapped(&self.stream, &r.func, r.cfg, &r.args)?;
            } else {
                self.launch_one(r)?;
            }
        }
        self.stats.kernel_launches += self.launches.len() as u64;
        Ok(())
    }

    /// Times each kernel of `steps` decode steps (launched one by one between CUDA events, so
    /// outside the graph) and returns, per kernel name, launches per token and microseconds
    /// per token, slowest first. The steps advance the sequence like any others.
    pub fn profile(&mut self, steps: usize) -> Result<Vec<(String, usize, f64)>, CudaError> {
        let mut per: HashMap<String, (usize, f64)> = HashMap::new();
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let steps = steps.max(1);
        for _ in 0..steps {
            if self.pos >= self.plan.n_ctx {
                return Err(CudaError::ContextFull {
                    n_ctx: self.plan.n_ctx,
                });
            }
            self.kick_cpu_tier()?;
            let mut events = Vec::with_capacity(self.launches.len());
            for r in &self.launches {
                let start = self.stream.record_event(flags).map_err(driver("event"))?;
                self.launch_one(r)?;
                let end = self.stream.record_event(flags).map_err(driver("event"))?;
                events.push((start, end));
            }
            self.stream.synchronize().map_err(driver("profiling"))?;
            for (r, (start, end)) in self.launches.iter().zip(&events) {
                let ms = start.elapsed_ms(end).map_err(driver("event time"))?;
                let e = per.entry(r.name.clone()).or_default();
                e.0 += 1;
                e.1 += f64::from(ms) * 1e3;
            }
            self.pos += 1;
            self.stats.tokens += 1;
        }
        let mut out: Vec<(String, usize, f64)> = per
            .into_iter()
            .map(|(k, (n, us))| (k, n / steps, us / steps as f64))
            .collect();
        out.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(out)
    }

    fn capture(&mut self) -> Result<(), CudaError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("beginning the capture"))?;
        let launched = self.launch_all();
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("ending the capture"))?;
        launched?;
        let graph = graph.ok_or_else(|| CudaError::Driver("the capture was empty".into()))?;
        graph.upload().map_err(driver("uploading the graph"))?;
        self.graph = Some(graph);
        Ok(())
    }

    /// The slot cache's turn before a decode step: every so many steps, the most chosen
    /// experts copied into the slots and the tables written (in stream order, before the
    /// step reads them).
    fn choose_slots(&mut self) -> Result<(), CudaError> {
        let Some(mut slots) = self.expert_slots.take() else {
            return Ok(());
        };
        let changed = slots.step(&self.stream, || self.expert_counts());
        let written = match changed {
            Ok(true) => slots
                .tables(&self.stream)
                .into_iter()
                .try_for_each(|(b, t)| self.write_buf(b, &t)),
            Ok(false) => Ok(()),
            Err(e) => Err(e),
        };
        self.expert_slots = Some(slots);
        written
    }

    /// Of each token's chosen experts in the layers left in host memory, how many the CPU
    /// computes: (layer, count) for each layer where it computes some.
    pub fn cpu_experts(&self) -> Vec<(usize, usize)> {
        (self.plan.cpu_experts.iter())
            .flat_map(|c| c.layers.iter().copied().zip(c.counts.iter().copied()))
            .collect()
    }

    /// Wakes the CPU tier's worker for a step about to be launched, after reporting what went
    /// wrong in the steps it served before.
    fn kick_cpu_tier(&self) -> Result<(), CudaError> {
        let Some(worker) = self.cpu_tier.as_ref().and_then(|t| t.worker.as_ref()) else {
            return Ok(());
        };
        if let Some(f) = worker.failure() {
            return Err(CudaError::Model(f));
        }
        worker.kick();
        Ok(())
    }

    /// Runs one step on the token and position already in device memory.
    fn run_step(&mut self) -> Result<(), CudaError> {
        if self.pos >= self.plan.n_ctx {
            return Err(CudaError::ContextFull {
                n_ctx: self.plan.n_ctx,
            });
        }
        self.ensure_room(0, self.pos + 1)?;
        self.choose_slots()?;
        self.kick_cpu_tier()?;
        match &self.graph {
            Some(g) => {
                g.launch().map_err(driver("launching the graph"))?;
                self.stats.graph_launches += 1;
            }
            None => self.launch_all()?,
        }
        if let Some(ring) = self.ring.as_mut() {
            let slot = self.pos % TOKEN_RING;
            ring.done[slot]
                .record(&self.stream)
                .map_err(driver("recording a step"))?;
            ring.last = Some(slot);
        }
        self.pos += 1;
        self.stats.tokens += 1;
        Ok(())
    }

    /// The CUDA device number.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The launch plan of one token.
    pub fn plan(&self) -> &DecodePlan {
        &self.plan
    }

    /// Whether the step runs as one captured graph.
    pub fn uses_graph(&self) -> bool {
        self.graph.is_some()
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Positions filled.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions the cache holds.
    pub fn n_ctx(&self) -> usize {
        self.plan.n_ctx
    }

    /// Weight bytes one token reads from host memory over the bus (the expert stacks a
    /// `--gpu-memory` budget left there).
    pub fn host_bytes_per_token(&self) -> u64 {
        self.plan
            .weight_bytes_per_token_of(|m| self.tiers[m] == Tier::Host)
    }

    /// What the memory tiers served for `counts` (the selection counters), and the expert
    /// rows' bytes on each tier; `None` when every expert is in device memory.
    pub fn expert_tiers(&self, counts: &[Vec<u64>]) -> Option<ferrolm_engine::ExpertTierStats> {
        let stack_bytes = |tier: Tier| -> u64 {
            (self.plan.matrices.iter().zip(&self.tiers))
                .filter(|&(m, &t)| m.experts > 1 && t == tier)
                .map(|(m, _)| m.total_bytes())
                .sum()
        };
        let host_expert_bytes = stack_bytes(Tier::Host);
        if host_expert_bytes == 0 {
            return None;
        }
        let t = crate::tiers::traffic(&self.plan, &self.tiers, counts);
        let on_cpu = self.cpu_tier.as_ref().and_then(|h| h.worker.as_ref());
        let cpu_selections = on_cpu.map_or(0, CpuTier::selections)
            + (self.prefill.as_ref())
                .and_then(Prefill::cpu_share_rows)
                .map_or(0, |(cpu, _)| cpu);
        // (the slot cache's hits and misses, where it has them: up to its last choice)
        if let Some(slots) = &self.expert_slots {
            let (hits, misses, slot_bytes, one) = slots.usage();
            return Some(ferrolm_engine::ExpertTierStats {
                device_expert_bytes: stack_bytes(Tier::Device) + slot_bytes,
                host_expert_bytes,
                device_selections: hits,
                host_selections: misses,
                cpu_selections,
                host_bytes: misses * one,
            });
        }
        Some(ferrolm_engine::ExpertTierStats {
            device_expert_bytes: stack_bytes(Tier::Device),
            host_expert_bytes,
            device_selections: t.device,
            host_selections: t.host,
            cpu_selections,
            host_bytes: t.host_bytes,
        })
    }

    /// How often each expert of each layer was chosen since the model was made (empty per
    /// dense layer), read from the device (a sync).
    pub fn expert_counts(&self) -> Result<Vec<Vec<u64>>, CudaError> {
        let mut out = Vec::with_capacity(self.plan.layers.len());
        for (l, r) in self.plan.layers.iter().enumerate() {
            let n = r.moe.as_ref().map_or(0, |m| m.n_expert);
            let mut bytes = vec![0u8; 4 * n];
            if let Some(&i) = self.buf_index.get(&Buf::ExpertCounts(l)) {
                self.stream
                    .memcpy_dtoh(&self._buffers[i].slice(..4 * n), &mut bytes)
                    .map_err(driver("reading the expert counters"))?;
            }
            out.push(bytes);
        }
        self.stream
            .synchronize()
            .map_err(driver("reading the expert counters"))?;
        Ok(out
            .iter()
            .map(|b| {
                b.chunks_exact(4)
                    .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect()
            })
            .collect())
    }

    /// The recurrent layers' state buffers, in layer order (none for a model without them).
    fn state_buffers(&self) -> Vec<usize> {
        (0..self.plan.layers.len())
            .flat_map(|l| [Buf::ConvState(l), Buf::SsmState(l)])
            .filter_map(|b| self.buf_index.get(&b).copied())
            .collect()
    }

    /// After a prompt on a model with recurrent layers: their states become the checkpoint
    /// [`CudaModel::truncate`] can go back to.
    fn checkpoint_prompt(&mut self, n_ids: usize) -> Result<(), CudaError> {
        if n_ids < 2 || !self.plan.recurrent() {
            return Ok(());
        }
        let mut copies = Vec::new();
        for i in self.state_buffers() {
            let copy = self
                .stream
                .clone_dtod(&self._buffers[i])
                .map_err(driver("saving the recurrent states"))?;
            copies.push(copy);
        }
        self.checkpoint = Some((self.pos, copies));
        Ok(())
    }

    /// Forgets the sequence (the next token goes to position 0).
    pub fn reset(&mut self) -> Result<(), CudaError> {
        self.checkpoint = None;
        self.stream
            .memcpy_htod(&[0u32], &mut self.pos_buf)
            .map_err(driver("resetting the position"))?;
        self.stats.uploads += 1;
        self.pos = 0;
        Ok(())
    }

    /// Keeps the first `pos` positions (at most the current one) and forgets the rest: the
    /// next token goes to position `pos` (a chat reusing the common start of a conversation).
    pub fn truncate(&mut self, pos: usize) -> Result<(), CudaError> {
        let pos = pos.min(self.pos);
        // A recurrent state holds only the latest position: going back resumes from the
        // checkpoint where it lies at or before `pos`, and starts over otherwise (the caller
        // reads the position and evaluates its ids again), as the CPU does; at position 0 the
        // step starts the states from zeros.
        let pos = if self.plan.recurrent() && pos < self.pos {
            match self.checkpoint.take() {
                Some((at, copies)) if at > 0 && at <= pos => {
                    for (i, copy) in self.state_buffers().into_iter().zip(&copies) {
                        self.stream
                            .memcpy_dtod(copy, &mut self._buffers[i])
                            .map_err(driver("restoring the recurrent states"))?;
                    }
                    self.checkpoint = Some((at, copies));
                    at
                }
                _ => 0,
            }
        } else {
            pos
        };
        self.stream
            .memcpy_htod(&[pos as u32], &mut self.pos_buf)
            .map_err(driver("setting the position"))?;
        self.stats.uploads += 1;
        self.pos = pos;
        Ok(())
    }

    /// Chooses each next token on the device: greedy (`None`, the default) or drawn as
    /// `sampling` says, the draws taken from `draws` in order (the host sampler's generator,
    /// so that the device picks what the CPU sampler would from the same logits). Errors when
    /// the settings need the host (`top_k` 0 or above [`SAMPLE_MAX_K`], temperature 0).
    pub fn set_sampling(
        &mut self,
        sampling: Option<DeviceSampling>,
        draws: &mut dyn FnMut() -> f32,
    ) -> Result<(), CudaError> {
        let (k, top_p, min_p, temp) = match &sampling {
            None => (0, 1.0, 0.0, 1.0),
            Some(s) => {
                if s.top_k == 0 || s.top_k > SAMPLE_MAX_K || s.temperature <= 0.0 {
                    return Err(CudaError::Model(format!(
                        "device sampling needs 1 <= top_k <= {SAMPLE_MAX_K} and a positive temperature"
                    )));
                }
                (s.top_k as i32, s.top_p, s.min_p, s.temperature)
            }
        };
        let mut cfg = Vec::with_capacity(20);
        cfg.extend_from_slice(&k.to_ne_bytes());
        cfg.extend_from_slice(&top_p.to_ne_bytes());
        cfg.extend_from_slice(&min_p.to_ne_bytes());
        cfg.extend_from_slice(&temp.to_ne_bytes());
        cfg.extend_from_slice(&(SAMPLE_DRAWS as i32).to_ne_bytes());
        self.write_buf(Buf::SampleCfg, &cfg)?;
        self.draws_used = None;
        if sampling.is_some() {
            self.refill_draws(draws)?;
        }
        Ok(())
    }

    /// Hands the device the next [`SAMPLE_DRAWS`] draws and restarts its count.
    fn refill_draws(&mut self, draws: &mut dyn FnMut() -> f32) -> Result<(), CudaError> {
        let bytes: Vec<u8> = (0..SAMPLE_DRAWS)
            .flat_map(|_| draws().to_ne_bytes())
            .collect();
        self.write_buf(Buf::Draws, &bytes)?;
        self.write_buf(Buf::DrawIdx, &0u32.to_ne_bytes())?;
        self.draws_used = Some(0);
        Ok(())
    }

    /// Before a step that may draw: new draws when the device has used them all.
    pub fn ensure_draws(&mut self, draws: &mut dyn FnMut() -> f32) -> Result<(), CudaError> {
        let Some(used) = self.draws_used else {
            return Ok(());
        };
        if used >= SAMPLE_DRAWS {
            self.refill_draws(draws)?;
        }
        // The step about to run takes one.
        self.draws_used = self.draws_used.map(|u| u + 1);
        Ok(())
    }

    fn write_buf(&mut self, b: Buf, bytes: &[u8]) -> Result<(), CudaError> {
        let Some(&i) = self.buf_index.get(&b) else {
            return Err(CudaError::Model(format!(
                "the step has no {b:?} buffer (only the first layers are on the device)"
            )));
        };
        let mut dst = self._buffers[i].slice_mut(..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut dst)
            .map_err(driver("writing the sampler's state"))?;
        self.stats.uploads += 1;
        Ok(())
    }

    /// Layers on the device.
    pub fn gpu_layers(&self) -> usize {
        self.plan.layers.len()
    }

    /// Whether the device holds the whole model (with its output head), not only its first
    /// layers.
    pub fn is_whole(&self) -> bool {
        self.plan.head.is_some()
    }

    fn whole(&self, what: &str) -> Result<(), CudaError> {
        if self.is_whole() {
            return Ok(());
        }
        Err(CudaError::Model(format!(
            "{what}: the device holds only the first {} layers (use eval_hidden)",
            self.gpu_layers()
        )))
    }

    /// Evaluates `ids` after what the model holds through the device's layers (a model of the
    /// first layers only) and returns the residual stream they leave, `n_embd` per token.
    pub fn eval_hidden(&mut self, ids: &[u32]) -> Result<Vec<f32>, CudaError> {
        if self.is_whole() {
            return Err(CudaError::Model(
                "eval_hidden: the device holds the whole model".into(),
            ));
        }
        self.check(ids)?;
        if ids.len() > 1 && self.prefill.is_some() {
            return self.eval_batched(ids, false);
        }
        let d = self.plan.n_embd;
        let mut out = Vec::with_capacity(ids.len() * d);
        let mut bytes = vec![0u8; 4 * d];
        for &id in ids {
            self.upload_token(id)?;
            self.run_step()?;
            let x = self._buffers[self.buf_index[&Buf::X]].slice(..4 * d);
            self.stream
                .memcpy_dtoh(&x, &mut bytes)
                .map_err(driver("reading the residual stream"))?;
            self.stream
                .synchronize()
                .map_err(driver("reading the residual stream"))?;
            self.stats.host_syncs += 1;
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        self.checkpoint_prompt(ids.len())?;
        Ok(out)
    }

    /// Whether `ids` can follow what the model holds: ids in the vocabulary, room in the cache.
    fn check(&self, ids: &[u32]) -> Result<(), CudaError> {
        self.check_at(self.pos, ids)
    }

    /// Whether `ids` can go at positions `pos0..`: ids in the vocabulary, room in the cache.
    fn check_at(&self, pos0: usize, ids: &[u32]) -> Result<(), CudaError> {
        if pos0 + ids.len() > self.plan.n_ctx {
            return Err(CudaError::ContextFull {
                n_ctx: self.plan.n_ctx,
            });
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.plan.n_vocab) {
            return Err(CudaError::Model(format!(
                "token {bad} is outside the vocabulary of {}",
                self.plan.n_vocab
            )));
        }
        Ok(())
    }

    fn upload_token(&mut self, id: u32) -> Result<(), CudaError> {
        self.stream
            .memcpy_htod(&[id], &mut self.token)
            .map_err(driver("uploading a token"))?;
        self.stats.uploads += 1;
        Ok(())
    }

    /// Evaluates `id` at the next position; its logits stay on the device, and the greedy
    /// choice becomes the device's next token.
    pub fn push(&mut self, id: u32) -> Result<(), CudaError> {
        self.whole("push")?;
        if id as usize >= self.plan.n_vocab {
            return Err(CudaError::Model(format!(
                "token {id} is outside the vocabulary of {}",
                self.plan.n_vocab
            )));
        }
        self.upload_token(id)?;
        self.run_step()
    }

    /// Evaluates the device's own greedy choice at the next position (no upload).
    pub fn push_greedy(&mut self) -> Result<(), CudaError> {
        self.whole("push_greedy")?;
        self.run_step()
    }

    /// [`CudaModel::push_greedy`], returning the id it evaluates: the step is queued before
    /// the host waits for the id, so the device goes from one step to the next without
    /// waiting for the host. A caller that stops at that id (end of generation) has evaluated
    /// one position more than it keeps: `truncate(position() - 1)` forgets it.
    pub fn push_greedy_ahead(&mut self) -> Result<u32, CudaError> {
        self.whole("push_greedy_ahead")?;
        match self.ring.as_ref().and_then(|r| r.last) {
            Some(slot) => {
                self.run_step()?;
                self.stats.host_syncs += 1;
                self.ring.as_ref().expect("present").read(slot)
            }
            None => {
                let id = self.greedy()?;
                self.run_step()?;
                Ok(id)
            }
        }
    }

    /// The device's choice at the last step (it waits for that step alone: read from the
    /// token ring, or after a prompt batch, copied).
    pub fn greedy(&mut self) -> Result<u32, CudaError> {
        self.whole("greedy")?;
        if let Some(slot) = self.ring.as_ref().and_then(|r| r.last) {
            self.stats.host_syncs += 1;
            return self.ring.as_ref().expect("present").read(slot);
        }
        let mut id = [0u32];
        self.stream
            .memcpy_dtoh(&self.token, &mut id)
            .map_err(driver("reading the token"))?;
        self.stream
            .synchronize()
            .map_err(driver("reading the token"))?;
        self.stats.host_syncs += 1;
        Ok(id[0])
    }

    /// The logits of the last step.
    pub fn logits(&mut self) -> Result<Vec<f32>, CudaError> {
        self.whole("logits")?;
        let mut out = vec![0f32; self.plan.n_vocab];
        self.stream
            .memcpy_dtoh(&self.logits, &mut out)
            .map_err(driver("reading the logits"))?;
        self.stream
            .synchronize()
            .map_err(driver("reading the logits"))?;
        self.stats.host_syncs += 1;
        Ok(out)
    }

    /// Evaluates `ids` as prompt batches from position 0 with every launch timed (CUDA
    /// events): per kernel name, launches and microseconds, slowest first. The sequence is
    /// reset before and after.
    pub fn profile_batch(&mut self, ids: &[u32]) -> Result<Vec<(String, usize, f64)>, CudaError> {
        let Some(p) = self.prefill.as_mut() else {
            return Ok(Vec::new());
        };
        p.set_profile(true)?;
        self.reset()?;
        let run = self.eval(ids, false);
        let rows = self.prefill.as_mut().expect("present").set_profile(false);
        self.reset()?;
        run?;
        rows
    }

    /// One batched decode step of `rows` slots (1 ..= `rows`, each at its caller-tracked
    /// position 0 unless it holds more: the step writes their position-0 cache rows) with
    /// every launch timed (CUDA events): per kernel name, launches and microseconds, slowest
    /// first. Needs more than `rows` slots.
    pub fn profile_rows(&mut self, rows: usize) -> Result<Vec<(String, usize, f64)>, CudaError> {
        if rows >= self.slots {
            return Err(CudaError::Model(format!(
                "a profiled step of {rows} rows needs more slots than {}",
                self.slots
            )));
        }
        let Some(p) = self.prefill.as_mut() else {
            return Ok(Vec::new());
        };
        p.set_profile(true)?;
        let ids = vec![1u32; rows];
        let slots: Vec<u32> = (1..=rows as u32).collect();
        let pos = vec![0u32; rows];
        let run = self.eval_rows(&ids, &slots, &pos, RowsWant::Greedy);
        let timed = self.prefill.as_mut().expect("present").set_profile(false);
        run?;
        timed
    }

    /// Whether prompts run as batches of GEMMs (cuBLAS found), not as decode steps.
    pub fn batched_prompts(&self) -> bool {
        self.prefill.is_some()
    }

    /// Evaluates `ids` after what the model holds and returns every position's logits (`all`)
    /// or the last one's; the greedy choice after the last becomes the device's next token.
    /// Several tokens go through the batched pass (batches of up to 512) when cuBLAS is
    /// present, one decode step each otherwise.
    pub fn eval(&mut self, ids: &[u32], all: bool) -> Result<Vec<f32>, CudaError> {
        self.whole("eval")?;
        self.check(ids)?;
        self.ensure_room(0, self.pos + ids.len())?;
        if ids.len() > 1 && self.prefill.is_some() {
            return self.eval_batched(ids, all);
        }
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            self.push(id)?;
            if all || i + 1 == ids.len() {
                out.extend(self.logits()?);
            }
        }
        self.checkpoint_prompt(ids.len())?;
        Ok(out)
    }

    /// Logits of the decode step (and only those) through single steps, whatever the batch
    /// size: `cuda-check` compares both paths with the CPU.
    pub fn eval_steps(&mut self, ids: &[u32]) -> Result<Vec<f32>, CudaError> {
        let mut out = Vec::new();
        for &id in ids {
            self.push(id)?;
            out.extend(self.logits()?);
        }
        Ok(out)
    }

    fn eval_batched(&mut self, ids: &[u32], all: bool) -> Result<Vec<f32>, CudaError> {
        let mut out = Vec::new();
        let at = self.addresses(0);
        if let Some(ring) = self.ring.as_mut() {
            ring.last = None;
        }
        let prefill = self.prefill.as_mut().expect("checked by the caller");
        let n_batches = ids.len().div_ceil(MAX_BATCH);
        for (i, batch) in ids.chunks(MAX_BATCH).enumerate() {
            let last = i + 1 == n_batches;
            out.extend(prefill.eval(&self.plan, &at, batch, self.pos, all, last)?);
            self.pos += batch.len();
            self.stats.tokens += batch.len() as u64;
            self.stats.batches += 1;
            self.stats.uploads += 1;
        }
        let pos = [self.pos as u32];
        self.stream
            .memcpy_htod(&pos, &mut self.pos_buf)
            .map_err(driver("setting the position"))?;
        self.stats.uploads += 1;
        self.checkpoint_prompt(ids.len())?;
        if !self.is_whole() {
            return Ok(out);
        }
        if all {
            // The last row is also the step's logits (for `logits()` and sampling).
            let n_vocab = self.plan.n_vocab;
            let last = out.len() - n_vocab;
            self.stream
                .memcpy_htod(&out[last..], &mut self.logits)
                .map_err(driver("the last logits"))?;
            self.stats.host_syncs += (ids.len().div_ceil(MAX_BATCH)) as u64;
        } else {
            out = self.logits()?;
        }
        Ok(out)
    }

    /// Waits for the device.
    pub fn synchronize(&mut self) -> Result<(), CudaError> {
        self.ctx.synchronize().map_err(driver("synchronizing"))?;
        self.stats.host_syncs += 1;
        Ok(())
    }
}

/// Compiles the kernels for `sm_<major><minor>`, or loads them from the cache.
fn load_module(
    ctx: &Arc<CudaContext>,
    major: i32,
    minor: i32,
    tuning: &CudaTuning,
) -> Result<Arc<cudarc::driver::CudaModule>, CudaError> {
    let arch = kernels::arch_name(major, minor);
    let dir = tuning.kernel_cache.as_deref();
    let source = kernels::source_with_defines(tuning.defines.clone());
    let source = source.as_str();
    let compile = || {
        let cubin = kernels::compile(source, &arch).map_err(CudaError::Compile)?;
        if let Some(dir) = dir {
            kernels::write_cached(dir, source, &arch, &cubin);
        }
        Ok::<_, CudaError>(cubin)
    };
    let load = |cubin: Vec<u8>| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin));
    match dir.and_then(|dir| kernels::read_cached(dir, source, &arch)) {
        // A cached image the driver refuses (damaged, or from another driver) is made again.
        Some(cached) => match load(cached) {
            Ok(module) => Ok(module),
            Err(_) => load(compile()?).map_err(driver("loading the kernels")),
        },
        None => load(compile()?).map_err(driver("loading the kernels")),
    }
}
