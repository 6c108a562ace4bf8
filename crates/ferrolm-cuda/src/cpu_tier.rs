//! The CPU tier of a GPU memory budget (`--gpu-memory`; docs/EXPERT_STREAMING.md): in a layer
//! whose expert stacks stay in host memory, the CPU computes the last `per_layer` of each
//! token's chosen experts while the GPU reads the others' rows over the bus, both at once, as
//! llama.cpp's `--n-cpu-moe` computes a layer's experts on the CPU (here a share of them, so
//! that the bus and the CPU's memory both work).
//!
//! The decode step hands the routing's last ids and the experts' input to mapped host memory
//! (`moe_cpu_publish`, right after the routing), runs its own share of the experts, then waits
//! for the CPU's outputs (`moe_cpu_wait`, before the weighted sum), which it copies among its
//! own: the sum is in slot order as before, so only the CPU's experts' rounding differs from
//! the GPU's (each the CPU forward pass's own bits: `ferrolm_model::HostExperts`). A worker
//! thread answers layer after layer, step after step; prompt batches (the batched passes) read
//! every expert over the bus and do not involve it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrolm_model::HostExperts;
use ferrolm_threads::ThreadPool;

use crate::schedule::{Arg, Buf, DecodePlan, Launch};
use crate::CudaError;

/// Bytes before a layer's input in its exchange: flags (published step, answered step, timed
/// out step) and the ids from byte 16 (`CPU_X_AT` in kernels.cu).
pub const EXCHANGE_INPUT_AT: usize = 256;
/// Byte of the ids in a layer's exchange.
const EXCHANGE_IDS_AT: usize = 16;
/// Most experts a layer may hand to the CPU (the ids' room before the input).
pub const MOST_PER_LAYER: usize = (EXCHANGE_INPUT_AT - EXCHANGE_IDS_AT) / 4;

/// The CPU tier of a decode plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuExperts {
    /// The layers, in order.
    pub layers: Vec<usize>,
    /// Of each token's chosen experts in each of those layers, how many (the last) the CPU
    /// computes.
    pub counts: Vec<usize>,
    /// Bytes of one layer's part of [`Buf::CpuExchange`].
    pub stride: usize,
}

impl CpuExperts {
    /// Bytes of the whole exchange.
    pub fn exchange_bytes(&self) -> usize {
        self.layers.len() * self.stride
    }
}

impl DecodePlan {
    /// Where layer `l`'s mixture of experts is in the launches: its routing, and its weighted
    /// sum after it (the expert products between them); else what is missing.
    pub(crate) fn moe_launches(&self, l: usize) -> Result<(usize, usize), String> {
        let counts = Arg::Buf(Buf::ExpertCounts(l));
        let route = (self.launches.iter())
            .position(|x| x.kernel.starts_with("moe_route") && x.args.contains(&counts))
            .ok_or_else(|| format!("layer {l}'s routing is not in the step"))?;
        let combine = (self.launches[route..].iter())
            .position(|x| x.kernel.starts_with("moe_combine"))
            .ok_or_else(|| format!("layer {l}'s weighted sum is not in the step"))?;
        Ok((route, route + combine))
    }

    /// The plan with the CPU computing the last `per_layer` chosen experts of each of
    /// `layers` (mixtures of experts, in order): the routed experts' launches of those layers
    /// take the first `k - per_layer` slots, a `moe_cpu_publish` follows the routing and a
    /// `moe_cpu_wait` precedes the weighted sum. `per_layer` may be all of a layer's `k`
    /// (experts streamed from the file, which only the CPU reads): the routed experts'
    /// launches then go. Errors when a layer has no experts, when `per_layer` exceeds a
    /// layer's `k` (or [`MOST_PER_LAYER`]), or when the shared expert runs in the routed
    /// experts' grid (`FERROLM_CUDA_SHARED_IN_GRID`).
    pub fn with_cpu_experts(
        self,
        layers: &[usize],
        per_layer: usize,
    ) -> Result<DecodePlan, CudaError> {
        let each: Vec<(usize, usize)> = layers.iter().map(|&l| (l, per_layer)).collect();
        self.with_cpu_experts_each(&each)
    }

    /// [`DecodePlan::with_cpu_experts`] with a count of its own for each layer: `(layer,
    /// count)` pairs in layer order, a count of 0 leaving its layer to the GPU.
    pub fn with_cpu_experts_each(
        mut self,
        each: &[(usize, usize)],
    ) -> Result<DecodePlan, CudaError> {
        let refuse = |what: String| Err(CudaError::Model(format!("the CPU tier: {what}")));
        let each: Vec<(usize, usize)> = each.iter().copied().filter(|&(_, c)| c > 0).collect();
        let Some(most) = each.iter().map(|&(_, c)| c).max() else {
            return Ok(self);
        };
        if self.cpu_experts.is_some() {
            return refuse("the plan has one already".into());
        }
        if most > MOST_PER_LAYER {
            return refuse(format!(
                "{most} experts a layer, past the {MOST_PER_LAYER} it has room for"
            ));
        }
        let d = self.n_embd;
        let stride = (EXCHANGE_INPUT_AT + 4 * d * (1 + most)).next_multiple_of(256);
        for (i, &(l, per_layer)) in each.iter().enumerate() {
            let Some(k) = self
                .layers
                .get(l)
                .and_then(|r| r.moe.as_ref())
                .map(|m| m.n_used)
            else {
                return refuse(format!("layer {l} has no experts"));
            };
            if per_layer > k {
                return refuse(format!(
                    "{per_layer} of layer {l}'s {k} chosen experts, more than it chooses"
                ));
            }
            let (route, mut combine) = match self.moe_launches(l) {
                Ok(span) => span,
                Err(what) => return refuse(what),
            };
            let n_ff = self.layers[l].moe.as_ref().map_or(0, |m| m.n_ff);
            let gated = [Buf::Gate, Buf::Up, Buf::Act].map(Arg::Buf);
            let mut gone = Vec::new();
            for (j, x) in self.launches[route + 1..combine].iter_mut().enumerate() {
                // (the activation between gate and up apart and the down products: over the
                // GPU's experts' rows only)
                if x.args.starts_with(&gated) && x.args.get(3) == Some(&Arg::I32((k * n_ff) as i32))
                {
                    let n = (k - per_layer) * n_ff;
                    x.args[3] = Arg::I32(n as i32);
                    x.grid.0 = n.div_ceil(x.block as usize) as u32;
                    if n == 0 {
                        gone.push(route + 1 + j);
                    }
                    continue;
                }
                // (the chosen ids, or the staged experts' `slots.rs`)
                if ![Buf::ExpertIds, Buf::SlotIds]
                    .iter()
                    .any(|&b| x.args.contains(&Arg::Buf(b)))
                {
                    continue;
                }
                if x.grid.1 as usize != k {
                    return refuse(format!(
                        "layer {l}'s {} has {} grid rows for {k} experts (the shared expert \
                         among them)",
                        x.kernel, x.grid.1
                    ));
                }
                x.grid.1 = (k - per_layer) as u32;
                if per_layer == k {
                    gone.push(route + 1 + j);
                }
            }
            // (a launch over no experts: none at all)
            for &j in gone.iter().rev() {
                self.launches.remove(j);
            }
            combine -= gone.len();
            let offset = Arg::I64((i * stride) as i64);
            let (k, c, d, slot) = (k as i32, per_layer as i32, d as i32, i as i32);
            self.launches.insert(
                combine,
                Launch {
                    kernel: "moe_cpu_wait".into(),
                    grid: (1, 1),
                    block: 512,
                    args: vec![
                        Arg::Buf(Buf::CpuExchange),
                        offset,
                        Arg::Buf(Buf::CpuSeq),
                        Arg::I32(slot),
                        Arg::Buf(Buf::ExpertOut),
                        Arg::I32(k),
                        Arg::I32(c),
                        Arg::I32(d),
                    ],
                    shared: 0,
                },
            );
            self.launches.insert(
                route + 1,
                Launch {
                    kernel: "moe_cpu_publish".into(),
                    grid: (1, 1),
                    block: 256,
                    args: vec![
                        Arg::Buf(Buf::ExpertIds),
                        Arg::I32(k),
                        Arg::I32(c),
                        Arg::Buf(Buf::H),
                        Arg::I32(d),
                        Arg::Buf(Buf::CpuExchange),
                        offset,
                        Arg::Buf(Buf::CpuSeq),
                        Arg::I32(slot),
                    ],
                    shared: 0,
                },
            );
        }
        self.cpu_experts = Some(CpuExperts {
            layers: each.iter().map(|&(l, _)| l).collect(),
            counts: each.iter().map(|&(_, c)| c).collect(),
            stride,
        });
        Ok(self)
    }
}

/// Of a layer's `k` chosen experts, how many the CPU should take so that both sides finish
/// soonest: the GPU reads its `k - c` over the bus at `bus_per_expert` seconds each while
/// the CPU computes `c` in `cpu[c - 1]` seconds (measured for `c` = 1 ..); 0 where the bus
/// alone is as fast. Ties go to the fewer on the CPU.
pub fn choose_cpu_experts(k: usize, bus_per_expert: f64, cpu: &[f64]) -> usize {
    let time = |c: usize| {
        let on_cpu = if c == 0 { 0.0 } else { cpu[c - 1] };
        on_cpu.max((k - c) as f64 * bus_per_expert)
    };
    (0..=cpu.len().min(k.saturating_sub(1)))
        .min_by(|&a, &b| time(a).total_cmp(&time(b)).then(a.cmp(&b)))
        .unwrap_or(0)
}

/// Times, for layer `l` of the plan (its stacks in host memory at `stacks`), the GPU reading
/// its `k` experts' rows over the bus (`moe_stage` into scratch stages, as the products read
/// them) and the CPU computing 1 .. k - 1 of them on `threads` threads, and returns
/// [`choose_cpu_experts`]'s count (`--cpu-experts auto`). `None`: the layer's rows are not
/// whole 16-byte words, so nothing was timed.
pub(crate) fn calibrate(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    module: &std::sync::Arc<cudarc::driver::CudaModule>,
    p: &DecodePlan,
    l: usize,
    stacks: [u64; 3],
    experts: &HostExperts,
    threads: usize,
) -> Result<Option<usize>, CudaError> {
    use crate::device::{driver, Value};
    use cudarc::driver::{sys, DevicePtr, LaunchConfig};
    let Some(moe) = p.layers.get(l).and_then(|r| r.moe.as_ref()) else {
        return Ok(None);
    };
    let (k, ne) = (moe.n_used, moe.n_expert);
    let bytes = moe.experts.map(|m| p.matrices[m].expert_bytes());
    if bytes.iter().any(|b| b % 16 != 0) || k < 2 {
        return Ok(None);
    }
    // The GPU: k experts' rows staged from host memory, the best of three.
    let table: Vec<u64> = (0..3)
        .flat_map(|m| (0..ne as u64).map(move |e| stacks[m] + e * bytes[m]))
        .collect();
    let table = stream
        .clone_htod(&table)
        .map_err(driver("the calibration's table"))?;
    let ids: Vec<u32> = (0..k as u32).collect();
    let ids = stream
        .clone_htod(&ids)
        .map_err(driver("the calibration's ids"))?;
    let stages = bytes
        .iter()
        .map(|&b| stream.alloc_zeros::<u8>(k * b as usize))
        .collect::<Result<Vec<_>, _>>()
        .map_err(driver("the calibration's stages"))?;
    let func = module
        .load_function("moe_stage")
        .map_err(driver("moe_stage"))?;
    let ptr = |s: &cudarc::driver::CudaSlice<u8>| s.device_ptr(stream).0;
    let args = [
        Value::Ptr(table.device_ptr(stream).0),
        Value::I32(ne as i32),
        Value::Ptr(ids.device_ptr(stream).0),
        Value::Ptr(ptr(&stages[0])),
        Value::Ptr(ptr(&stages[1])),
        Value::Ptr(ptr(&stages[2])),
        Value::I64(bytes[0] as i64),
        Value::I64(bytes[1] as i64),
        Value::I64(bytes[2] as i64),
    ];
    let cfg = LaunchConfig {
        grid_dim: (32, k as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut bus = f64::INFINITY;
    for round in 0..4 {
        let start = stream.record_event(flags).map_err(driver("event"))?;
        crate::device::launch(stream, &func, cfg, &args)?;
        let end = stream.record_event(flags).map_err(driver("event"))?;
        end.synchronize().map_err(driver("the calibration"))?;
        let ms = start.elapsed_ms(&end).map_err(driver("event time"))?;
        // (the first round warms up)
        if round > 0 {
            bus = bus.min(f64::from(ms) * 1e-3 / k as f64);
        }
    }
    // The CPU: 1 .. k - 1 of them, the best of three each.
    let pool = ThreadPool::new(threads)
        .map_err(|e| CudaError::Model(format!("the CPU tier's threads: {e}")))?;
    let d = experts.d();
    let x: Vec<f32> = (0..d)
        .map(|i| ((i * 7919) % 17) as f32 / 8.0 - 1.0)
        .collect();
    let mut y = vec![0f32; k * d];
    let mut cpu = Vec::with_capacity(k - 1);
    for c in 1..k {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            experts
                .outputs(&pool, l, &ids_of(c, ne), &x, &mut y[..c * d])
                .map_err(|e| CudaError::Model(e.to_string()))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        cpu.push(best);
    }
    Ok(Some(choose_cpu_experts(k, bus, &cpu)))
}

/// `c` distinct experts of `ne`, spread over the layer.
fn ids_of(c: usize, ne: usize) -> Vec<u32> {
    (0..c).map(|j| ((j * ne) / c.max(1)) as u32).collect()
}

/// What the worker and the model share.
struct Shared {
    stop: AtomicBool,
    failure: Mutex<Option<String>>,
    /// Selections (one token's expert in one layer) answered.
    selections: AtomicU64,
}

/// The thread that answers the decode step's requests, and the exchange it answers in.
pub(crate) struct CpuTier {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The exchange's host address and the layers' strides, for the timed-out flags.
    host: usize,
    tier: CpuExperts,
}

/// How long the worker spins on a flag before it sleeps between looks (a step's layers come
/// well within it; the first layer after an idle spell waits for [`CpuTier::kick`]).
const SPIN: Duration = Duration::from_millis(5);
/// How long it sleeps between looks after that.
const NAP: Duration = Duration::from_micros(500);
/// How long it sleeps between looks for a step's first request (a kick wakes it sooner).
const IDLE_NAP: Duration = Duration::from_millis(20);

impl CpuTier {
    /// Starts the worker over `experts` (the tier's layers), answering in the exchange at host
    /// address `host` (mapped pinned memory of `tier.exchange_bytes()`, zeroed, alive as long
    /// as this), on `threads` threads.
    ///
    /// # Safety
    /// `host` must point to that memory, valid until this is dropped.
    pub(crate) unsafe fn start(
        experts: HostExperts,
        tier: &CpuExperts,
        host: *mut u8,
        threads: usize,
    ) -> Result<CpuTier, CudaError> {
        let pool = ThreadPool::new(threads)
            .map_err(|e| CudaError::Model(format!("the CPU tier's threads: {e}")))?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
            selections: AtomicU64::new(0),
        });
        let (t, s, at) = (tier.clone(), shared.clone(), host as usize);
        let thread = std::thread::Builder::new()
            .name("ferrolm-cpu-tier".into())
            .spawn(move || serve(&experts, &pool, &t, at, &s))
            .map_err(|e| CudaError::Model(format!("the CPU tier's worker: {e}")))?;
        Ok(CpuTier {
            shared,
            thread: Some(thread),
            host: host as usize,
            tier: tier.clone(),
        })
    }

    /// Wakes the worker for a step about to be launched.
    pub(crate) fn kick(&self) {
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }

    /// Selections (one token's expert in one layer) computed so far.
    pub(crate) fn selections(&self) -> u64 {
        self.shared.selections.load(Ordering::Relaxed)
    }

    /// What went wrong in a step served so far: the worker's failure, or a step whose wait
    /// ran out of time.
    pub(crate) fn failure(&self) -> Option<String> {
        if let Some(f) = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Some(f);
        }
        self.tier.layers.iter().enumerate().find_map(|(i, &l)| {
            // SAFETY: the exchange outlives self; the flag is a u32 at a 256-byte boundary.
            let late = unsafe { flag(self.host + i * self.tier.stride, 2) }.load(Ordering::Acquire);
            (late != 0).then(|| {
                format!("layer {l}'s experts on the CPU did not come back in time (step {late})")
            })
        })
    }
}

impl Drop for CpuTier {
    // (the model synchronizes its stream first: no step still waits for an answer)
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Flag `i` of the exchange part at `at`.
///
/// # Safety
/// `at` must be a live exchange part (16-byte aligned, at least 16 bytes).
unsafe fn flag<'a>(at: usize, i: usize) -> &'a AtomicU32 {
    &*((at + 4 * i) as *const AtomicU32)
}

/// Waits until `f` holds `want`; false: stopped first. `idle`: the wait for a step's first
/// request, which once spinning is over sleeps until [`CpuTier::kick`] (every launch of a
/// step kicks first) or [`IDLE_NAP`] (a kick taken by an earlier wait, for a step queued
/// ahead); a later layer's request comes without a kick, so its wait only naps.
fn wait_for(f: &AtomicU32, want: u32, stop: &AtomicBool, idle: bool) -> bool {
    let start = Instant::now();
    let mut looks = 0u32;
    loop {
        if f.load(Ordering::Acquire) == want {
            return true;
        }
        if stop.load(Ordering::Acquire) {
            return false;
        }
        looks = looks.wrapping_add(1);
        if !looks.is_multiple_of(1024) || start.elapsed() < SPIN {
            std::hint::spin_loop();
        } else if idle {
            std::thread::park_timeout(IDLE_NAP);
        } else {
            std::thread::park_timeout(NAP);
        }
    }
}

/// The worker: each layer of the tier in turn, the next step's request answered when it is
/// published. A failure is kept for the model to report and the step still answered (with
/// zeros), so that the device never waits in vain.
fn serve(experts: &HostExperts, pool: &ThreadPool, tier: &CpuExperts, host: usize, s: &Shared) {
    let d = experts.d();
    let most = tier.counts.iter().copied().max().unwrap_or(0);
    let mut answered = vec![0u32; tier.layers.len()];
    let mut ids_of = vec![0u32; most];
    let mut x = vec![0f32; d];
    let mut y_of = vec![0f32; most * d];
    loop {
        for (i, &l) in tier.layers.iter().enumerate() {
            let c = tier.counts[i];
            let (ids, y) = (&mut ids_of[..c], &mut y_of[..c * d]);
            let at = host + i * tier.stride;
            let want = answered[i].wrapping_add(1);
            // SAFETY: the exchange outlives the worker (CpuTier's drop joins it first).
            if !wait_for(unsafe { flag(at, 0) }, want, &s.stop, i == 0) {
                return;
            }
            // SAFETY: the device wrote the ids and the input before publishing `want`, which
            // the acquiring load saw; they stay until the step's wait has read the answer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (at + EXCHANGE_IDS_AT) as *const u32,
                    ids.as_mut_ptr(),
                    c,
                );
                std::ptr::copy_nonoverlapping(
                    (at + EXCHANGE_INPUT_AT) as *const f32,
                    x.as_mut_ptr(),
                    d,
                );
            }
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                experts.outputs(pool, l, ids, &x, y)
            }));
            let failed = match result {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some("the worker panicked".into()),
            };
            if let Some(f) = failed {
                y.fill(0.0);
                let mut kept = s.failure.lock().unwrap_or_else(|e| e.into_inner());
                kept.get_or_insert(format!("layer {l}'s experts on the CPU: {f}"));
            }
            // SAFETY: as above; the device reads the outputs only after `want` is answered.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    y.as_ptr(),
                    (at + EXCHANGE_INPUT_AT + 4 * d) as *mut f32,
                    c * d,
                );
                flag(at, 1).store(want, Ordering::Release);
            }
            answered[i] = want;
            s.selections.fetch_add(c as u64, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_takes_the_experts_that_let_both_sides_finish_soonest() {
        // 8 experts at 1 ms each over the bus; the CPU 1.5 ms for one, then 1 ms more each.
        let cpu: Vec<f64> = (1..8).map(|c| 0.5e-3 + 1e-3 * c as f64).collect();
        // c = 3: max(3.5, 5) = 5 ms; c = 4: max(4.5, 4) = 4.5 ms; c = 5: max(5.5, 3) = 5.5 ms.
        assert_eq!(choose_cpu_experts(8, 1e-3, &cpu), 4);
        // A CPU slower than the whole bus read: none.
        assert_eq!(choose_cpu_experts(8, 1e-3, &[9e-3; 7]), 0);
        // A very fast CPU still leaves the GPU one expert.
        assert_eq!(choose_cpu_experts(8, 1e-3, &[1e-9; 7]), 7);
        assert_eq!(choose_cpu_experts(1, 1e-3, &[]), 0);
    }
    use ferrolm_model::synthetic::{self, SyntheticSpec};
    use ferrolm_model::Model;

    /// The worker against the test thread playing the device: for three steps, each layer's
    /// request published as the kernels publish it (ids, input, then the step number), the
    /// answer waited for and compared with `HostExperts::outputs` bit for bit; a failure and a
    /// timed-out step are reported; dropping stops the worker.
    #[test]
    fn the_worker_answers_each_layer_s_request_in_turn() {
        let mut spec = SyntheticSpec::small("qwen3moe");
        spec.n_expert = 16;
        let file = std::sync::Arc::new(
            ferrolm_gguf::GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes())
                .unwrap(),
        );
        let model = Model::from_file(file, 1).unwrap();
        let (c, d) = (2, spec.n_embd);
        let tier = CpuExperts {
            layers: vec![1, 3],
            counts: vec![c; 2],
            stride: (EXCHANGE_INPUT_AT + 4 * d * (1 + c)).next_multiple_of(256),
        };
        // (u64s: the exchange's 16-byte flags aligned as the device's allocation is)
        let mut exchange = vec![0u64; tier.exchange_bytes() / 8];
        let host = exchange.as_mut_ptr().cast::<u8>();
        let reference = model.host_experts(&tier.layers).unwrap();
        // SAFETY: `exchange` outlives the worker (dropped at the end of this test, after it).
        let worker =
            unsafe { CpuTier::start(model.host_experts(&tier.layers).unwrap(), &tier, host, 2) }
                .unwrap();
        let pool = ThreadPool::new(1).unwrap();
        for step in 1..=3u32 {
            worker.kick();
            for (i, &l) in tier.layers.iter().enumerate() {
                let at = host as usize + i * tier.stride;
                let ids = [step % 16, (step * 5 + i as u32) % 16];
                let x: Vec<f32> = (0..d)
                    .map(|j| ((j as u32 * step) % 7) as f32 - 3.0)
                    .collect();
                // SAFETY: the part lies in `exchange`; the worker reads it only after the flag.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        ids.as_ptr(),
                        (at + EXCHANGE_IDS_AT) as *mut u32,
                        c,
                    );
                    std::ptr::copy_nonoverlapping(
                        x.as_ptr(),
                        (at + EXCHANGE_INPUT_AT) as *mut f32,
                        d,
                    );
                    flag(at, 0).store(step, Ordering::Release);
                }
                let stop = AtomicBool::new(false);
                // SAFETY: as above.
                assert!(wait_for(unsafe { flag(at, 1) }, step, &stop, false));
                let mut got = vec![0f32; c * d];
                // SAFETY: the worker wrote the answer before the flag, which was seen.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (at + EXCHANGE_INPUT_AT + 4 * d) as *const f32,
                        got.as_mut_ptr(),
                        c * d,
                    );
                }
                let mut want = vec![0f32; c * d];
                reference.outputs(&pool, l, &ids, &x, &mut want).unwrap();
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "step {step}, layer {l}"
                );
            }
        }
        assert_eq!(worker.failure(), None);
        assert_eq!(worker.selections(), (3 * tier.layers.len() * c) as u64);
        // A step the device gave up waiting for is reported, naming its layer.
        // SAFETY: as above.
        unsafe { flag(host as usize + tier.stride, 2).store(4, Ordering::Release) };
        let late = worker.failure().expect("a late step is a failure");
        assert!(
            late.contains("layer 3") && late.contains("step 4"),
            "{late}"
        );
        // A request the experts cannot serve (an id past the layer's) is answered with zeros
        // and reported.
        let at = host as usize;
        worker.kick();
        // SAFETY: as above.
        unsafe {
            std::ptr::copy_nonoverlapping(
                [99u32, 0].as_ptr(),
                (at + EXCHANGE_IDS_AT) as *mut u32,
                c,
            );
            flag(at, 0).store(4, Ordering::Release);
            assert!(wait_for(flag(at, 1), 4, &AtomicBool::new(false), false));
        }
        let failed = worker.failure().expect("a failed request is a failure");
        assert!(
            failed.contains("layer 1") && failed.contains("expert 99"),
            "{failed}"
        );
        drop(worker);
        drop(exchange);
    }
}
