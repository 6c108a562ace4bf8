//! A prompt as one batch: every matrix product a GEMM on the tensor cores (cuBLAS), the
//! weights dequantized to f16 one matrix at a time into a scratch buffer, activations f16 as
//! GEMM inputs and f32 everywhere else.
//!
//! Decode reads each weight once per token, so it works on the quantized blocks directly;
//! a prompt of hundreds of tokens reads each weight once per batch, so converting a matrix to
//! f16 (one pass over it) and handing the product to cuBLAS costs little and gains the tensor
//! cores. The residual adds come free: the output projections accumulate into the residual
//! stream (`beta = 1`).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaModule, CudaStream};
use ferrolm_gguf::TensorType;

use crate::batch_device::{BatchDevice, CudaBatch, Gemm, Value};
use crate::cpu_prompt::PromptCpuShare;
use crate::device::Rows;
use crate::schedule::{
    activation_format, expert_product_kernel, DecodePlan, DeltaNetProjection, DeltaNetRefs,
    GateActivation, LayerRefs, MatrixSpec, MixerRefs, MoeRefs, MATVEC_ROWS,
};
use crate::{CudaError, CudaTuning};

/// Tokens in one batch: longer prompts go through in batches of this many.
pub const MAX_BATCH: usize = 512;

/// Tokens per chunk of a prompt's delta rule (the CPU's chunk; `DELTA_CHUNK` in the kernels).
const DELTA_CHUNK: usize = 64;

/// Tokens per block of the batched attention (`QT` in the kernels).
const ATTN_TILE: usize = 16;

/// The tensor-core attention kernel for heads of `head_dim` (`attn_mma_64`, `_128`, `_256`)
/// and its tokens per block (`FQ` in the kernels: 16 a warp), or `None`: the f32 tiles
/// (`attn_tile`) then.
pub fn mma_attention(head_dim: usize) -> Option<(&'static str, usize)> {
    match head_dim {
        64 => Some(("attn_mma_64", 64)),
        128 => Some(("attn_mma_128", 64)),
        256 => Some(("attn_mma_256", 32)),
        _ => None,
    }
}

/// The device addresses the batched pass reads and writes besides its own buffers.
pub struct Addresses {
    /// Each matrix of the plan (its first row).
    pub matrices: Vec<u64>,
    /// Each vector of the plan (f32).
    pub vectors: Vec<u64>,
    /// Each layer's key and value cache (f16) of the slot evaluated.
    pub k_cache: Vec<u64>,
    /// See `k_cache`.
    pub v_cache: Vec<u64>,
    /// Each layer's recurrent states (convolution, delta rule; f32), zeros for attention.
    pub states: Vec<[u64; 2]>,
    /// Each layer's expert counters (u32 per expert; 0: dense), shared by every slot.
    pub expert_counts: Vec<u64>,
    /// The decode step's last-token buffers: logits and the chosen token.
    pub logits: u64,
    /// See `logits`.
    pub token: u64,
    /// The step's sampler: its settings, draws and draw count (0: none, greedy).
    pub sampling: [u64; 3],
}

/// How a batch's tokens meet the caches.
#[derive(Clone, Copy)]
enum Placement<'a> {
    /// One sequence's ids at positions `pos0..`, attending causally within the batch.
    Prompt { pos0: usize },
    /// One id of each of several slots: token t at the slot and position uploaded to
    /// `row_slots[t]` and `row_pos[t]`; slot s of layer l's cache starts `slot_stride[l]`
    /// halfs after slot s - 1.
    Slots {
        slot_stride: &'a [usize],
        /// The slot the padding rows write to.
        spare: u32,
    },
}

/// The largest `k` a batched step returns candidates for ([`RowsWant::Top`]).
pub const TOP_MAX: usize = 256;

/// What the batched decode step returns for its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsWant {
    /// Every row's logits.
    Logits,
    /// Every row's greedy choice.
    Greedy,
    /// Every row's `k` largest logits with their ids (at most [`TOP_MAX`]).
    Top(usize),
}

/// The batched passes of one model: the device (the GPU, or a test's host emulation), the
/// kernels' batch buffers on it.
pub struct Prefill<D: BatchDevice = CudaBatch> {
    dev: D,
    ids: D::Buffer<u32>,
    x: D::Buffer<f32>,
    h: D::Buffer<u16>,
    q: D::Buffer<f32>,
    k: D::Buffer<f32>,
    v: D::Buffer<f32>,
    attn: D::Buffer<u16>,
    gate: D::Buffer<f32>,
    up: D::Buffer<f32>,
    act: D::Buffer<u16>,
    w16: D::Buffer<u16>,
    /// The last token's normed residual stream (the output product's input).
    last: D::Buffer<f32>,
    all_logits: Option<D::Buffer<f32>>,
    /// The batched decode step's slot and position of each token, and each row's greedy id.
    row_slots: D::Buffer<u32>,
    row_pos: D::Buffer<u32>,
    row_ids: D::Buffer<u32>,
    /// Each row's largest logits and their ids ([`RowsWant::Top`]).
    top_ids: D::Buffer<u32>,
    top_vals: D::Buffer<f32>,
    /// Every quantized matrix as f16, kept (`f16_weights`): GEMMs then read them as they are
    /// instead of dequantizing one matrix at a time. Empty: not kept.
    /// Where each matrix's copy starts (`None`: not kept, or f16 in the file).
    w16_kept: Vec<Option<u64>>,
    /// Per layer: Q, K and V stacked as one f16 matrix, and gate and up (one product each in a
    /// batched decode step); each matrix's copy above lies inside its stack.
    qkv_kept: Vec<Option<u64>>,
    gate_up_kept: Vec<Option<u64>>,
    /// The device memory of the copies.
    w16_owned: Vec<D::Buffer<u16>>,
    /// The fused products' outputs: each token's (q | k | v), and its (gate | up).
    qkv_rows: Option<D::Buffer<f32>>,
    gate_up_rows: Option<D::Buffer<f32>>,
    /// The batched decode step's graph per padded row count (`None`: run once, not captured
    /// yet), and whether graphs are used (as the tuning says, and not after a capture failed).
    row_graphs: HashMap<usize, Option<D::Graph>>,
    graphs: bool,
    /// The switches and sizes it was made with (tensor-core attention, the matrix-vector
    /// blocks' threads).
    tuning: CudaTuning,
    /// The mixture-of-experts layers' buffers (`None`: a dense model).
    moe: Option<MoeBuffers<D>>,
    /// The hybrids' buffers (`None`: no delta-net layer or gated attention output).
    hybrid: Option<HybridBuffers<D>>,
    /// A small batched step's activations quantized for the `mmq_*` products
    /// (`quantize_rows_f16`'s layout, [`CudaTuning::mmq_max_rows`] rows), which input they
    /// hold (consecutive products of one input quantize it once), and whether the step being
    /// launched uses them.
    xq_rows: Option<D::Buffer<u32>>,
    /// Such a step's attention output in f32, the output product's input to quantize.
    attn32: Option<D::Buffer<f32>>,
    xq_holds: Option<(u64, i32)>,
    mmq_step: bool,
    /// Whether the step being launched multiplies Q4_K matrices through `dq4k_gemm_*`
    /// ([`CudaTuning::dq_gemm_max_rows`]).
    dq_step: bool,
    /// `dq4k_pipe_*`'s runs' sums and its row blocks' counts of finished runs (zero between
    /// launches).
    dq_partial: D::Buffer<f32>,
    dq_counters: D::Buffer<u32>,
    /// The CPU's part of the host-memory layers' expert groups (`cpu_prompt.rs`).
    cpu_share: Option<PromptCpuShare>,
}

/// The most rows of a batched step whose Q4_K products read the blocks (`dq4k_gemm_16`).
pub const DQ_MAX_ROWS: usize = crate::batch_device::SKINNY_MOST_ROWS;
/// Matrix rows of a `dq4k_gemm_*` block: `skinny_gemm`'s block layout.
pub const DQ_ROWS: usize = crate::batch_device::SKINNY_BLOCK_ROWS;

/// The layouts of `dq4k_pipe_*` that the kernels define: (warps a block, stages): the fastest
/// of the six measured (docs/PERFORMANCE.md, sessions 17 and 18), all slower than `dq4k_gemm_*`.
pub const DQ_PIPES: [(usize, usize); 1] = [(4, 3)];
/// About how many blocks a `dq4k_pipe_*` launch aims at (two an SM of a 132-SM GPU): a matrix
/// of fewer row blocks splits its columns into that many runs. A constant rather than the
/// device's count, so that the sums' order is the matrix's alone.
const DQ_PIPE_BLOCKS: usize = 264;

/// A `dq4k_pipe_*` launch over `rows` rows of `n_sb` super-blocks, `warps` warps a block:
/// (row blocks, runs, super-blocks a run).
pub fn dq_pipe_grid(rows: usize, n_sb: usize, warps: usize) -> (usize, usize, usize) {
    let row_blocks = rows.div_ceil(32 * warps);
    let runs = (DQ_PIPE_BLOCKS / row_blocks).clamp(1, n_sb.max(1));
    let run = n_sb.div_ceil(runs);
    (row_blocks, n_sb.div_ceil(run).max(1), run)
}

/// The layout of `dq6k_pipe_*` (Q6_KR rows): warps a block, super-blocks in flight.
pub const DQ6_PIPE: (usize, usize) = (4, 3);
/// Bytes of a row's super-block in a pipeline's stage: Q4_K's block, Q6_KR's four fields.
pub const DQ4K_STAGE_ROW: usize = 144;
/// See [`DQ4K_STAGE_ROW`].
pub const DQ6K_STAGE_ROW: usize = 224;

/// Dynamic shared memory of a `dq4k_pipe_*` or `dq6k_pipe_*` block: each stage's weights
/// (`row` bytes a row of a super-block) and `tiles` x 8 input rows of 256 f16 columns.
pub fn dq_pipe_shared(row: usize, warps: usize, stages: usize, tiles: usize) -> u32 {
    (stages * (32 * warps * row + tiles * 8 * 512)) as u32
}

/// (f32 sums, counters) a pipelined launch of plan `p`'s Q4_K or Q6_KR matrices needs at most.
fn dq_pipe_scratch(p: &DecodePlan) -> (usize, usize) {
    let mut most = (1, 1);
    for &(warps, _) in &DQ_PIPES {
        for m in p.matrices.iter().filter(|m| has_dq(m) || has_dq6(m)) {
            let (row_blocks, runs, _) = dq_pipe_grid(m.rows, m.cols / 256, warps);
            if runs > 1 {
                // (16 sums a thread: two tiles of rows by two of inputs)
                most.0 = most.0.max(runs * row_blocks * 32 * warps * 16);
            }
            most.1 = most.1.max(row_blocks);
        }
    }
    most
}

/// Whether `dq6k_pipe_*` multiplies a matrix's rows: Q6_K regrouped (Q6_KR), not an expert
/// stack.
fn has_dq6(spec: &MatrixSpec) -> bool {
    spec.experts == 1 && spec.ty == TensorType::Q6_K && spec.kernel == "Q6_KR"
}

/// Whether `dq4k_gemm_*` multiplies a matrix's rows: plain Q4_K blocks, not an expert stack,
/// whole super-blocks (its weights then start on 16 bytes wherever the matrix does).
fn has_dq(spec: &MatrixSpec) -> bool {
    spec.experts == 1
        && spec.ty == TensorType::Q4_K
        && spec.kernel == "Q4_K"
        && spec.cols.is_multiple_of(256)
}

/// Rows and columns of an `mmq_*` block (`MMQ_ROWS`, `MMQ_COLS` in the kernels) and its threads.
pub const MMQ_ROWS: usize = 16;
/// See [`MMQ_ROWS`].
pub const MMQ_COLS: usize = 16;
const MMQ_THREADS: u32 = 128;

/// Whether a matrix's rows have an `mmq_*` kernel (`mmq_` and [`MatrixSpec::kernel`]).
fn has_mmq(spec: &MatrixSpec) -> bool {
    spec.experts == 1 && matches!(spec.ty, TensorType::Q4_K | TensorType::Q6_K)
}

/// What a batch's delta-net layers and gated attention outputs hold between launches: the
/// gated Q projection's rows and their gates; the delta-net's projections (input, output gates,
/// rates and decay inputs: fused or apart), the convolution's output rows and the gated-normed
/// read-out (f16, the output GEMM's input).
struct HybridBuffers<D: BatchDevice> {
    q_gated: D::Buffer<f32>,
    attn_gate: D::Buffer<f32>,
    input: D::Buffer<f32>,
    z: D::Buffer<f32>,
    ba: D::Buffer<f32>,
    alpha: D::Buffer<f32>,
    conv: D::Buffer<f32>,
    /// A prompt's chunked delta rule: its read-outs in f32, each chunk's Gram blocks.
    read_out: D::Buffer<f32>,
    gram: D::Buffer<f32>,
    out: D::Buffer<u16>,
}

impl<D: BatchDevice> HybridBuffers<D> {
    /// Each buffer's elements (`MAX_BATCH` tokens): the f32 ones in field order, then the f16.
    fn lens(p: &DecodePlan) -> ([usize; 9], usize) {
        let gated = p.max_attn > p.max_q;
        let b = MAX_BATCH;
        let f = [
            if gated { b * p.max_attn } else { 0 },
            if gated { b * p.max_q } else { 0 },
            b * p.delta.input,
            b * p.delta.z,
            b * p.delta.gates,
            b * p.delta.alpha,
            b * p.delta.channels,
            b * p.delta.value,
            b.div_ceil(DELTA_CHUNK) * p.delta.key_heads * 2 * DELTA_CHUNK * DELTA_CHUNK,
        ];
        (f, b * p.delta.value)
    }

    /// The buffers, when the plan has such layers.
    fn new(dev: &D, p: &DecodePlan) -> Result<Option<HybridBuffers<D>>, CudaError> {
        let (f, h) = HybridBuffers::<D>::lens(p);
        if f.iter().sum::<usize>() + h == 0 {
            return Ok(None);
        }
        let f32s = |n: usize| dev.alloc_zeros::<f32>(n.max(1), "hybrid buffers");
        Ok(Some(HybridBuffers {
            q_gated: f32s(f[0])?,
            attn_gate: f32s(f[1])?,
            input: f32s(f[2])?,
            z: f32s(f[3])?,
            ba: f32s(f[4])?,
            alpha: f32s(f[5])?,
            conv: f32s(f[6])?,
            read_out: f32s(f[7])?,
            gram: f32s(f[8])?,
            out: dev.alloc_zeros::<u16>(h.max(1), "hybrid buffers")?,
        }))
    }

    /// Their bytes.
    fn bytes(p: &DecodePlan) -> usize {
        let (f, h) = HybridBuffers::<D>::lens(p);
        4 * f.iter().sum::<usize>() + 2 * h
    }
}

/// What a batch's mixture-of-experts layers hold between launches: each token's router
/// logits, chosen experts and weights; the (token, slot) pairs grouped by expert (counts,
/// offsets, each pair's grouped row, the gathered inputs); each pair's expert output; the
/// normed rows in f32 (the batched step's per-pair products read them); the shared expert's
/// output and gate logit.
struct MoeBuffers<D: BatchDevice> {
    logits: D::Buffer<f32>,
    ids: D::Buffer<u32>,
    weights: D::Buffer<f32>,
    counts: D::Buffer<u32>,
    offsets: D::Buffer<u32>,
    at: D::Buffer<u32>,
    gathered: D::Buffer<u16>,
    outputs: D::Buffer<f32>,
    normed: D::Buffer<f32>,
    shared_out: D::Buffer<f32>,
    shared_gate: D::Buffer<f32>,
}

impl<D: BatchDevice> MoeBuffers<D> {
    /// Each buffer's elements: the 4-byte ones in field order, then the f16 gathered rows
    /// (`MAX_BATCH` tokens and their pairs).
    fn lens(p: &DecodePlan) -> ([usize; 10], usize) {
        let (pairs, d) = (MAX_BATCH * p.max_used, p.n_embd);
        let four = [
            MAX_BATCH * p.max_experts,
            pairs,
            pairs,
            p.max_experts,
            p.max_experts,
            pairs,
            2 * pairs * d,
            MAX_BATCH * d,
            MAX_BATCH * d,
            MAX_BATCH,
        ];
        // (the outputs and the gathered rows hold the groups padded to the largest: twice the
        // pairs at most)
        (four, 2 * pairs * d)
    }

    fn new(dev: &D, p: &DecodePlan) -> Result<MoeBuffers<D>, CudaError> {
        let f32s = |n: usize| dev.alloc_zeros::<f32>(n.max(1), "expert buffers");
        let u32s = |n: usize| dev.alloc_zeros::<u32>(n.max(1), "expert buffers");
        let (
            [logits, ids, weights, counts, offsets, at, outputs, normed, shared_out, shared_gate],
            gathered,
        ) = MoeBuffers::<D>::lens(p);
        Ok(MoeBuffers {
            logits: f32s(logits)?,
            ids: u32s(ids)?,
            weights: f32s(weights)?,
            counts: u32s(counts)?,
            offsets: u32s(offsets)?,
            at: u32s(at)?,
            gathered: dev.alloc_zeros::<u16>(gathered.max(1), "expert buffers")?,
            outputs: f32s(outputs)?,
            normed: f32s(normed)?,
            shared_out: f32s(shared_out)?,
            shared_gate: f32s(shared_gate)?,
        })
    }

    /// Their bytes.
    fn bytes(p: &DecodePlan) -> usize {
        let (four, two) = MoeBuffers::<D>::lens(p);
        4 * four.iter().sum::<usize>() + 2 * two
    }
}

/// A batch token's width of the feed-forward buffers (gate, up, activation): the widest
/// feed-forward block, twice that with experts (their groups padded to the largest, at most
/// twice the pairs).
fn ff_rows(p: &DecodePlan) -> usize {
    if p.max_experts > 0 {
        2 * p.max_ff
    } else {
        p.max_ff
    }
}

/// Bytes of device memory the batch buffers take (besides the logits of every position).
pub fn scratch_bytes(p: &DecodePlan) -> u64 {
    let widest = widest_matrix(p);
    let per_token = 4 * (p.n_embd + 2 * p.max_q + 2 * p.max_kv + 2 * ff_rows(p).max(p.n_embd))
        + 2 * (p.n_embd.max(p.max_q).max(p.max_ff) + p.max_q + ff_rows(p));
    let moe = if p.max_experts > 0 {
        MoeBuffers::<CudaBatch>::bytes(p)
    } else {
        0
    };
    let hybrid = HybridBuffers::<CudaBatch>::bytes(p);
    let (sums, counters) = dq_pipe_scratch(p);
    (MAX_BATCH * per_token + 2 * widest + 4 * p.n_embd + moe + hybrid + 4 * (sums + counters))
        as u64
}

/// Elements of the largest matrix (the f16 scratch holds one at a time).
fn widest_matrix(p: &DecodePlan) -> usize {
    p.matrices
        .iter()
        .map(|m| m.rows * m.cols)
        .max()
        .unwrap_or(0)
}

impl Prefill {
    /// Allocates the batch buffers, or `None` when cuBLAS is not on this machine or the plan
    /// has layers the prompt pass does not serve ([`DecodePlan::batched_passes_serve`]):
    /// prompts then run as decode steps. `sm90`: the device can launch a kernel overlapping
    /// its predecessor ([`CudaTuning::batch_overlap`]).
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        module: &Arc<CudaModule>,
        p: &DecodePlan,
        tuning: &CudaTuning,
        sm90: bool,
    ) -> Result<Option<Prefill>, CudaError> {
        if !p.batched_passes_serve() {
            return Ok(None);
        }
        let overlap = sm90 && tuning.batch_overlap;
        match CudaBatch::new(stream, module, tuning.skinny_gemm_max_rows, overlap)? {
            Some(dev) => Prefill::on(dev, p, tuning).map(Some),
            None => Ok(None),
        }
    }

    /// Bytes f16 copies of the expert stacks take ([`Prefill::keep_f16_experts`]).
    pub fn f16_expert_bytes(p: &DecodePlan) -> u64 {
        p.matrices
            .iter()
            .filter(|m| m.ty != TensorType::F16 && m.experts > 1)
            .map(|m| 2 * (m.rows * m.cols) as u64)
            .sum()
    }

    /// Bytes an f16 copy of every quantized matrix takes ([`Prefill::keep_f16_weights`]).
    pub fn f16_weight_bytes(p: &DecodePlan) -> u64 {
        p.matrices
            .iter()
            .filter(|m| m.ty != TensorType::F16 && m.experts == 1)
            .map(|m| 2 * (m.rows * m.cols) as u64)
            .sum()
    }
}

impl<D: BatchDevice> Prefill<D> {
    /// The batch buffers of plan `p` allocated on `dev`.
    pub fn on(dev: D, p: &DecodePlan, tuning: &CudaTuning) -> Result<Prefill<D>, CudaError> {
        let widest = widest_matrix(p);
        let b = MAX_BATCH;
        let f32s = |n: usize| dev.alloc_zeros::<f32>(n.max(1), "batch buffers");
        let f16s = |n: usize| dev.alloc_zeros::<u16>(n.max(1), "batch buffers");
        let (pipe_sums, pipe_counters) = dq_pipe_scratch(p);
        Ok(Prefill {
            ids: dev.alloc_zeros::<u32>(b, "batch ids")?,
            x: f32s(b * p.n_embd)?,
            h: f16s(b * p.n_embd.max(p.max_q).max(p.max_ff))?,
            q: f32s(b * p.max_q)?,
            k: f32s(b * p.max_kv)?,
            v: f32s(b * p.max_kv)?,
            attn: f16s(b * p.max_q)?,
            // (also a block's output before its post-norm: n_embd wide)
            gate: f32s(b * ff_rows(p).max(p.n_embd))?,
            up: f32s(b * ff_rows(p).max(p.n_embd))?,
            act: f16s(b * ff_rows(p))?,
            w16: f16s(widest)?,
            last: f32s(p.n_embd)?,
            all_logits: None,
            row_slots: dev.alloc_zeros::<u32>(b, "batch slots")?,
            row_pos: dev.alloc_zeros::<u32>(b, "batch positions")?,
            row_ids: dev.alloc_zeros::<u32>(b, "batch choices")?,
            top_ids: dev.alloc_zeros::<u32>(b * TOP_MAX, "batch candidates")?,
            top_vals: dev.alloc_zeros::<f32>(b * TOP_MAX, "batch candidates")?,
            w16_kept: Vec::new(),
            qkv_kept: Vec::new(),
            gate_up_kept: Vec::new(),
            w16_owned: Vec::new(),
            qkv_rows: None,
            gate_up_rows: None,
            row_graphs: HashMap::new(),
            graphs: tuning.graphs,
            tuning: tuning.clone(),
            moe: if p.max_experts > 0 {
                Some(MoeBuffers::new(&dev, p)?)
            } else {
                None
            },
            hybrid: HybridBuffers::new(&dev, p)?,
            xq_rows: if tuning.mmq_max_rows > 0 {
                let cols = p.matrices.iter().map(|m| m.cols).max().unwrap_or(0);
                let rows = tuning.mmq_max_rows.min(MAX_BATCH);
                // (bytes: rows of cols values and cols / 32 pairs of f32 scales)
                let words = rows * (cols + cols / 4) / 4;
                Some(dev.alloc_zeros::<u32>(words.max(1), "quantized rows")?)
            } else {
                None
            },
            attn32: if tuning.mmq_max_rows > 0 {
                let rows = tuning.mmq_max_rows.min(MAX_BATCH);
                Some(dev.alloc_zeros::<f32>((rows * p.max_q).max(1), "attention rows")?)
            } else {
                None
            },
            xq_holds: None,
            mmq_step: false,
            dq_step: false,
            dq_partial: f32s(pipe_sums)?,
            dq_counters: dev.alloc_zeros::<u32>(pipe_counters, "batch counters")?,
            cpu_share: None,
            dev,
        })
    }

    /// The device it runs on.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Has the CPU compute part of the expert groups of the layers `share` serves, in prompt
    /// batches and batched decode steps (`cpu_prompt.rs`). Those steps then group their pairs
    /// by expert as prompts do, which reads the counts back: they run launch by launch, not
    /// as graphs.
    pub fn set_cpu_share(&mut self, share: PromptCpuShare) {
        self.cpu_share = Some(share);
        self.graphs = false;
    }

    /// Rows (token, expert pairs) computed on the CPU and on the GPU in the layers the CPU
    /// shares so far; `None` without a share.
    pub fn cpu_share_rows(&self) -> Option<(u64, u64)> {
        self.cpu_share.as_ref().map(PromptCpuShare::rows)
    }

    fn run(
        &mut self,
        kernel: &str,
        grid: (u32, u32),
        block: u32,
        args: &[Value],
    ) -> Result<(), CudaError> {
        // (any other kernel may write the rows the quantized ones came from)
        if !kernel.starts_with("mmq_") {
            self.xq_holds = None;
        }
        self.dev.launch(kernel, grid, block, args)
    }

    /// The next token from the `vocab` logits at `logits`, as the decode step chooses it.
    fn choose(&mut self, at: &Addresses, logits: u64, vocab: usize) -> Result<(), CudaError> {
        let [cfg, draws, idx] = at.sampling;
        self.run(
            "choose_token",
            (1, 1),
            1024,
            &[
                Value::Ptr(logits),
                Value::I32(vocab as i32),
                Value::Ptr(at.token),
                Value::Ptr(0),
                Value::I32(0),
                Value::Ptr(cfg),
                Value::Ptr(draws),
                Value::Ptr(idx),
                // No ring: the host reads a batch's choice from `token`.
                Value::Ptr(0),
            ],
        )
    }

    /// `dst` (f16, row-major) = the matrix of `spec` at `addr`.
    fn dequantize(&mut self, spec: &MatrixSpec, addr: u64, dst: u64) -> Result<(), CudaError> {
        let chunks = spec.cols / 32;
        let total = (spec.rows * chunks) as u64;
        let w16 = dst;
        let ty = spec.kernel;
        self.run(
            &format!("dequant_f16_{ty}"),
            (total.div_ceil(256) as u32, 1),
            256,
            &[
                Value::Ptr(addr),
                Value::I32(spec.row_bytes() as i32),
                Value::I32(chunks as i32),
                Value::I64(total as i64),
                Value::Ptr(w16),
            ],
        )
    }

    /// `c[t][r] = a[t] . w[r] (+ beta * c[t][r])` for `n` rows `t` of `a` (f16, `cols` wide)
    /// and the `rows` rows of `w` (f16); `c` is f32, `rows` wide.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &mut self,
        w16: u64,
        rows: usize,
        cols: usize,
        a: u64,
        n: usize,
        c: u64,
        beta: f32,
    ) -> Result<(), CudaError> {
        self.xq_holds = None;
        self.dev.gemm(Gemm {
            w16,
            rows,
            cols,
            a,
            n,
            c,
            beta,
            f32_operands: false,
            batch: 1,
        })
    }

    /// Starts (or stops and returns) timing each launch of the next batches with events:
    /// microseconds per kernel name, slowest first.
    pub fn set_profile(&mut self, on: bool) -> Result<Vec<(String, usize, f64)>, CudaError> {
        self.dev.set_profile(on)
    }

    /// The residual stream's `n` rows normed by `weight` into `out` as f32.
    fn norm_rows_f32(
        &mut self,
        weight: u64,
        out: u64,
        n: usize,
        p: &DecodePlan,
    ) -> Result<(), CudaError> {
        let warps = p.n_embd.div_ceil(256).clamp(1, 32) as u32;
        let x = self.dev.address(&self.x);
        self.run(
            "rms_norm_rows_f32",
            (n as u32, 1),
            32 * warps,
            &[
                Value::Ptr(x),
                Value::Ptr(weight),
                Value::Ptr(out),
                Value::I32(p.n_embd as i32),
                Value::F32(p.norm_eps),
            ],
        )
    }

    /// `c = a W^T (+ beta c)` for matrix `m` of the plan: dequantize, then GEMM.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        m: usize,
        a: u64,
        n: usize,
        c: u64,
        beta: f32,
    ) -> Result<(), CudaError> {
        let spec = &p.matrices[m];
        if self.mmq_step && has_mmq(spec) {
            return self.product_mmq(spec, at.matrices[m], a, n, c, beta);
        }
        let w = at.matrices[m];
        if self.reads_blocks(spec) && (w | a).is_multiple_of(16) {
            self.xq_holds = None;
            if has_dq6(spec) || self.tuning.dq_pipe.is_some() {
                return self.product_pipe(spec, w, a, n, c, beta);
            }
            // One tile of 8 inputs where they fit, else two.
            let kernel = if n <= 8 {
                "dq4k_gemm_8"
            } else {
                "dq4k_gemm_16"
            };
            return self.run(
                kernel,
                (spec.rows.div_ceil(DQ_ROWS) as u32, 1),
                crate::batch_device::SKINNY_THREADS,
                &[
                    Value::Ptr(w),
                    Value::I32(spec.row_bytes() as i32),
                    Value::I32(spec.rows as i32),
                    Value::I32((spec.cols / 256) as i32),
                    Value::Ptr(a),
                    Value::I32(spec.cols as i32),
                    Value::I32(n as i32),
                    Value::Ptr(c),
                    Value::F32(beta),
                    self.dq_prefetch_flag(),
                ],
            );
        }
        // F16 weights are GEMM operands as they are; kept f16 copies too.
        let kept = self.w16_kept.get(m).copied().flatten();
        let w16 = if spec.ty == TensorType::F16 {
            at.matrices[m]
        } else if let Some(w) = kept {
            w
        } else {
            let dst = self.dev.address(&self.w16);
            self.dequantize(spec, at.matrices[m], dst)?;
            dst
        };
        self.gemm(w16, spec.rows, spec.cols, a, n, c, beta)
    }

    /// [`Prefill::product`] of matrices `ms` (each with its output) of the one input `a`: those
    /// that go through `dq4k_gemm_*`, two or three of one width, as one `dq4k_gemm3_*` launch
    /// where the tuning asks for it ([`CudaTuning::dq_segments`]), the rest one by one.
    fn products(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        ms: &[(usize, u64)],
        a: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let (joint, alone): (Vec<_>, Vec<_>) = ms
            .iter()
            .copied()
            .partition(|&(m, _)| self.tuning.dq_segments && self.by_dq4k_gemm(p, at, m, a));
        let one_width = joint
            .iter()
            .all(|&(m, _)| p.matrices[m].cols == p.matrices[joint[0].0].cols);
        if joint.len() < 2 || !one_width {
            for &(m, c) in ms {
                self.product(p, at, m, a, n, c, 0.0)?;
            }
            return Ok(());
        }
        self.xq_holds = None;
        let spec = &p.matrices[joint[0].0];
        let mut args = Vec::new();
        let mut blocks = 0;
        for i in 0..3 {
            let (w, rows, c) = joint
                .get(i)
                .map_or((0, 0, 0), |&(m, c)| (at.matrices[m], p.matrices[m].rows, c));
            blocks += rows.div_ceil(DQ_ROWS);
            args.extend([Value::Ptr(w), Value::I32(rows as i32), Value::Ptr(c)]);
        }
        args.extend([
            Value::I32(spec.row_bytes() as i32),
            Value::I32((spec.cols / 256) as i32),
            Value::Ptr(a),
            Value::I32(spec.cols as i32),
            Value::I32(n as i32),
            Value::F32(0.0),
            self.dq_prefetch_flag(),
        ]);
        let kernel = if n <= 8 {
            "dq4k_gemm3_8"
        } else {
            "dq4k_gemm3_16"
        };
        let threads = crate::batch_device::SKINNY_THREADS;
        self.run(kernel, (blocks as u32, 1), threads, &args)?;
        for (m, c) in alone {
            self.product(p, at, m, a, n, c, 0.0)?;
        }
        Ok(())
    }

    /// The Q4_K block products' last argument: whether a block asks L2 for its weight rows as
    /// it starts (where the launch overlaps the one before, so that it starts early).
    fn dq_prefetch_flag(&self) -> Value {
        Value::I32(i32::from(self.tuning.batch_overlap))
    }

    /// Whether [`Prefill::product`] of matrix `m` with input `a` launches `dq4k_gemm_*`.
    fn by_dq4k_gemm(&self, p: &DecodePlan, at: &Addresses, m: usize, a: u64) -> bool {
        let spec = &p.matrices[m];
        self.tuning.dq_pipe.is_none()
            && has_dq(spec)
            && self.reads_blocks(spec)
            && !(self.mmq_step && has_mmq(spec))
            && (at.matrices[m] | a).is_multiple_of(16)
    }

    /// Gate `g` and up `u` of input `a` and the activation into `act` (f16) as one
    /// `dq4k_glu_*` launch, where the tuning asks for it ([`CudaTuning::dq_glu`]) and both
    /// go through `dq4k_gemm_*`: whether it launched.
    #[allow(clippy::too_many_arguments)]
    fn dq_glu(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        [g, u]: [usize; 2],
        activation: GateActivation,
        (a, n): (u64, usize),
        act: u64,
    ) -> Result<bool, CudaError> {
        let gelu = match activation {
            GateActivation::Silu => 0,
            GateActivation::Gelu => 1,
            GateActivation::SwigluOai => return Ok(false),
        };
        let (sg, su) = (&p.matrices[g], &p.matrices[u]);
        if !self.tuning.dq_glu
            || !self.by_dq4k_gemm(p, at, g, a)
            || !self.by_dq4k_gemm(p, at, u, a)
            || (sg.rows, sg.cols) != (su.rows, su.cols)
        {
            return Ok(false);
        }
        self.xq_holds = None;
        let kernel = if n <= 8 { "dq4k_glu_8" } else { "dq4k_glu_16" };
        self.run(
            kernel,
            (sg.rows.div_ceil(16) as u32, 1),
            crate::batch_device::SKINNY_THREADS,
            &[
                Value::Ptr(at.matrices[g]),
                Value::Ptr(at.matrices[u]),
                Value::I32(sg.row_bytes() as i32),
                Value::I32(sg.rows as i32),
                Value::I32((sg.cols / 256) as i32),
                Value::Ptr(a),
                Value::I32(sg.cols as i32),
                Value::I32(n as i32),
                Value::Ptr(act),
                Value::I32(gelu),
                self.dq_prefetch_flag(),
            ],
        )?;
        Ok(true)
    }

    /// Whether the step being launched reads matrix `spec`'s blocks (`dq4k_gemm_*`,
    /// `dq4k_pipe_*`, `dq6k_pipe_*`) rather than an f16 copy.
    fn reads_blocks(&self, spec: &MatrixSpec) -> bool {
        self.dq_step && (has_dq(spec) || (self.tuning.dq6_pipe && has_dq6(spec)))
    }

    /// [`Prefill::product`] of a Q6_KR matrix at `w` by `dq6k_pipe_*`, or of a Q4_K one by
    /// `dq4k_pipe_*` in the tuning's layout (docs/ARCHITECTURE.md, "Batched decode").
    fn product_pipe(
        &mut self,
        spec: &MatrixSpec,
        w: u64,
        a: u64,
        n: usize,
        c: u64,
        beta: f32,
    ) -> Result<(), CudaError> {
        let tiles = if n <= 8 { 1 } else { 2 };
        let n_sb = spec.cols / 256;
        let ((warps, stages), row, kernel) = match self.tuning.dq_pipe {
            _ if has_dq6(spec) => (DQ6_PIPE, DQ6K_STAGE_ROW, format!("dq6k_pipe_{}", 8 * tiles)),
            Some((w, s)) => (
                (w, s),
                DQ4K_STAGE_ROW,
                format!("dq4k_pipe_{}_{w}x{s}", 8 * tiles),
            ),
            None => unreachable!("a Q4_K matrix through the pipeline without its layout"),
        };
        let (row_blocks, runs, run) = dq_pipe_grid(spec.rows, n_sb, warps);
        let (partial, counters) = (
            self.dev.address(&self.dq_partial),
            self.dev.address(&self.dq_counters),
        );
        self.dev.launch_shared(
            &kernel,
            (row_blocks as u32, runs as u32),
            32 * warps as u32,
            dq_pipe_shared(row, warps, stages, tiles),
            &[
                Value::Ptr(w),
                Value::I32(spec.row_bytes() as i32),
                Value::I32(spec.rows as i32),
                Value::I32(n_sb as i32),
                Value::I32(run as i32),
                Value::Ptr(a),
                Value::I32(spec.cols as i32),
                Value::I32(n as i32),
                Value::Ptr(c),
                Value::F32(beta),
                Value::Ptr(partial),
                Value::Ptr(counters),
            ],
        )
    }

    /// [`Prefill::product`] of a small batched step: the `n` f16 input rows at `a` quantized
    /// to Q8_K (once for consecutive products of the same input), then `mmq_*`, which reads
    /// the matrix's blocks once for every row on the int8 tensor cores.
    fn product_mmq(
        &mut self,
        spec: &MatrixSpec,
        w: u64,
        a: u64,
        n: usize,
        c: u64,
        beta: f32,
    ) -> Result<(), CudaError> {
        let cols = spec.cols;
        let xq = self
            .xq_rows
            .as_ref()
            .map(|b| self.dev.address(b))
            .expect("the quantized rows are kept when mmq_max_rows > 0");
        let mode = activation_format(spec.ty).expect("an 8-bit activation format");
        if self.xq_holds != Some((a, mode)) {
            self.quantize_rows("quantize_rows_f16", a, (n, cols), (xq, mode))?;
            self.xq_holds = Some((a, mode));
        }
        self.run(
            &format!("mmq_{}", spec.kernel),
            (
                n.div_ceil(MMQ_COLS) as u32,
                spec.rows.div_ceil(MMQ_ROWS) as u32,
            ),
            MMQ_THREADS,
            &[
                Value::Ptr(w),
                Value::I32(spec.row_bytes() as i32),
                Value::I32((cols / 32) as i32),
                Value::I32(spec.rows as i32),
                Value::Ptr(xq),
                Value::I32(n as i32),
                Value::Ptr(c),
                Value::F32(beta),
            ],
        )
    }

    /// The `n` rows of `cols` values at `x` quantized into `xq` for activation format `mode`
    /// (`kernel`: `quantize_rows_f16` or `_f32`, after the rows' type).
    fn quantize_rows(
        &mut self,
        kernel: &str,
        x: u64,
        (n, cols): (usize, usize),
        (xq, mode): (u64, i32),
    ) -> Result<(), CudaError> {
        let args = [
            Value::Ptr(x),
            Value::Ptr(xq),
            Value::I32(cols as i32),
            Value::I32(mode),
        ];
        let grid = (cols.div_ceil(256 * 8) as u32, n as u32);
        self.run(kernel, grid, 256, &args)
    }

    /// Whether matrices `ms` are multiplied as one stacked f16 GEMM in the step being launched
    /// (where a stacked copy is kept): not when they all go through `mmq_*`, nor when one of
    /// them reads its Q4_K blocks (`dq4k_gemm_*`).
    fn stacks(&self, p: &DecodePlan, ms: &[usize]) -> bool {
        let reads_blocks = ms.iter().any(|&m| self.reads_blocks(&p.matrices[m]));
        !self.all_mmq(p, ms) && !reads_blocks
    }

    /// Whether matrices `ms` go through `mmq_*` in the step being launched (then not as one
    /// stacked f16 GEMM).
    fn all_mmq(&self, p: &DecodePlan, ms: &[usize]) -> bool {
        self.mmq_step && ms.iter().all(|&m| has_mmq(&p.matrices[m]))
    }

    /// Keeps an f16 copy of every quantized matrix, so that a batch's GEMMs read each weight
    /// once (2 bytes a weight) instead of dequantizing it first (its blocks read, f16 written
    /// and read again): what a decode step of many sequences wants.
    pub fn keep_f16_weights(&mut self, p: &DecodePlan, at: &Addresses) -> Result<(), CudaError> {
        if !self.w16_owned.is_empty() {
            return Ok(());
        }
        let mut kept: Vec<Option<u64>> = vec![None; p.matrices.len()];
        // One allocation of the matrices `ms` stacked row after row (its start), or `None`
        // when one is f16 in the file or their widths differ.
        let stack = |this: &mut Prefill<D>, ms: &[usize], kept: &mut Vec<Option<u64>>| {
            let specs: Vec<&MatrixSpec> = ms.iter().map(|&m| &p.matrices[m]).collect();
            if specs
                .iter()
                .any(|m| m.ty == TensorType::F16 || m.cols != specs[0].cols)
            {
                return Ok::<_, CudaError>(None);
            }
            let total: usize = specs.iter().map(|m| m.rows * m.cols).sum();
            let w = this
                .dev
                .alloc_zeros::<u16>(total, "f16 copies of the weights")?;
            let base = this.dev.address(&w);
            let mut offset = 0u64;
            for (&m, spec) in ms.iter().zip(&specs) {
                this.dequantize(spec, at.matrices[m], base + 2 * offset)?;
                kept[m] = Some(base + 2 * offset);
                offset += (spec.rows * spec.cols) as u64;
            }
            this.w16_owned.push(w);
            Ok(Some(base))
        };
        let mut qkv = Vec::with_capacity(p.layers.len());
        let mut gate_up = Vec::with_capacity(p.layers.len());
        for r in &p.layers {
            qkv.push(match r.attention() {
                Some(ar) => stack(self, &ar.qkv, &mut kept)?,
                None => None,
            });
            // (experts are read by the per-pair products in their blocks)
            let dense = r.moe.is_none();
            gate_up.push(if dense {
                stack(self, &r.ffn[..2], &mut kept)?
            } else {
                None
            });
        }
        for m in 0..p.matrices.len() {
            let spec = &p.matrices[m];
            if kept[m].is_none() && spec.ty != TensorType::F16 && spec.experts == 1 {
                kept[m] = stack(self, &[m], &mut kept)?;
            }
        }
        let any = |v: &[Option<u64>]| v.iter().any(Option::is_some);
        if any(&qkv) {
            self.qkv_rows =
                Some(self.dev.alloc_zeros::<f32>(
                    MAX_BATCH * (p.max_q + 2 * p.max_kv),
                    "fused product rows",
                )?);
        }
        if any(&gate_up) {
            self.gate_up_rows = Some(
                self.dev
                    .alloc_zeros::<f32>(MAX_BATCH * 2 * p.max_ff, "fused product rows")?,
            );
        }
        self.w16_kept = kept;
        self.qkv_kept = qkv;
        self.gate_up_kept = gate_up;
        Ok(())
    }

    /// Keeps an f16 copy of every expert stack, so that a prompt's grouped GEMMs read the
    /// experts as they are instead of dequantizing three stacks a layer. After
    /// [`Prefill::keep_f16_weights`], which replaces the list of copies.
    pub fn keep_f16_experts(&mut self, p: &DecodePlan, at: &Addresses) -> Result<(), CudaError> {
        self.keep_f16_experts_within(p, at, u64::MAX).map(|_| ())
    }

    /// [`Prefill::keep_f16_experts`] for the stacks, in the plan's order, whose copies fit in
    /// `room` bytes together (the others dequantized for each batch, as without copies):
    /// the bytes kept.
    pub fn keep_f16_experts_within(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        room: u64,
    ) -> Result<u64, CudaError> {
        self.w16_kept.resize(p.matrices.len(), None);
        let mut kept = 0u64;
        for (m, spec) in p.matrices.iter().enumerate() {
            let bytes = 2 * (spec.rows * spec.cols) as u64;
            if spec.experts > 1 && spec.ty != TensorType::F16 && self.w16_kept[m].is_none() {
                if kept + bytes > room {
                    break;
                }
                kept += bytes;
                let w = self
                    .dev
                    .alloc_zeros::<u16>(spec.rows * spec.cols, "f16 copies of the experts")?;
                let base = self.dev.address(&w);
                self.dequantize(spec, at.matrices[m], base)?;
                self.w16_kept[m] = Some(base);
                self.w16_owned.push(w);
            }
        }
        Ok(kept)
    }

    /// The embedding and every layer for `ids` (at most [`MAX_BATCH`]): the residual stream
    /// of every token in `x`, the caches written as `rows` says.
    fn layers(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        ids: &[u32],
        rows: Placement<'_>,
    ) -> Result<(), CudaError> {
        let n = ids.len();
        assert!(n > 0 && n <= MAX_BATCH, "batch of {n}");
        self.dev
            .upload(ids, &mut self.ids, "uploading the prompt")?;
        self.launch_layers(p, at, n, rows)
    }

    /// [`Prefill::layers`] for the `n` ids already uploaded: kernel launches only (a graph
    /// can capture them).
    fn launch_layers(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        n: usize,
        rows: Placement<'_>,
    ) -> Result<(), CudaError> {
        let d = p.n_embd;
        let eps = Value::F32(p.norm_eps);
        let (x, h, q, k, v) = (
            self.dev.address(&self.x),
            self.dev.address(&self.h),
            self.dev.address(&self.q),
            self.dev.address(&self.k),
            self.dev.address(&self.v),
        );
        let attn = self.dev.address(&self.attn);
        let embd = &p.matrices[p.embd];
        let chunks = d / 32;
        self.run(
            &format!("embed_rows_{}", embd.kernel),
            (chunks.div_ceil(128) as u32, n as u32),
            128,
            &[
                Value::Ptr(at.matrices[p.embd]),
                Value::I32(embd.row_bytes() as i32),
                Value::I32(chunks as i32),
                Value::Ptr(self.dev.address(&self.ids)),
                Value::Ptr(x),
            ],
        )?;
        if let Some(scale) = p.embedding_scale {
            let total = (n * d) as u64;
            self.run(
                "scale_f32",
                (total.div_ceil(256) as u32, 1),
                256,
                &[Value::Ptr(x), Value::I64(total as i64), Value::F32(scale)],
            )?;
        }
        let opt = |i: Option<usize>| Value::Ptr(i.map_or(0, |i| at.vectors[i]));
        for (l, r) in p.layers.iter().enumerate() {
            let next = r.attention().map_or(&[][..], |a| &a.qkv[..]);
            self.norm_rows(p, at.vectors[r.attn_norm], n, next)?;
            let ar = match &r.mixer {
                MixerRefs::Attention(a) => a,
                MixerRefs::DeltaNet(dn) => {
                    self.delta_net(p, at, l, dn, n, rows)?;
                    let out = self.hybrid.as_ref().map(|b| self.dev.address(&b.out));
                    let out = out.expect("a plan with delta-nets has their buffers");
                    let end = (r.post_attn_norm, r.residual_scale);
                    self.block_output(p, at, (dn.out, None), out, n, end)?;
                    self.feed_forward(p, at, l, r, n, rows)?;
                    continue;
                }
            };
            // A batched decode step reads Q, K and V as one stacked matrix where it is kept:
            // each token's row of the product is then (q | k | v).
            let q_dim = ar.n_head * ar.head_dim;
            let kv_dim = ar.n_head_kv * ar.head_dim;
            let fused_qkv = match rows {
                Placement::Slots { .. } if !ar.gated_output && self.stacks(p, &ar.qkv) => {
                    self.qkv_kept.get(l).copied().flatten()
                }
                _ => None,
            };
            let (q, k, v, q_stride, kv_stride) = match (fused_qkv, &self.qkv_rows) {
                (Some(w), Some(rows_buf)) => {
                    let out = self.dev.address(rows_buf);
                    let width = q_dim + 2 * kv_dim;
                    self.gemm(w, width, d, h, n, out, 0.0)?;
                    let f = 4 * q_dim as u64;
                    (out, out + f, out + f + 4 * kv_dim as u64, width, width)
                }
                _ => {
                    // A gated Q projection: its rows apart into the queries and the gates.
                    let gated =
                        self.hybrid.as_ref().filter(|_| ar.gated_output).map(|b| {
                            (self.dev.address(&b.q_gated), self.dev.address(&b.attn_gate))
                        });
                    let outs = [gated.map_or(q, |g| g.0), k, v];
                    let qkv: Vec<(usize, u64)> = ar.qkv.iter().copied().zip(outs).collect();
                    self.products(p, at, &qkv, h, n)?;
                    if let Some((qg, g)) = gated {
                        self.run(
                            "split_query_gate_rows",
                            (q_dim.div_ceil(256) as u32, n as u32),
                            256,
                            &[
                                Value::Ptr(qg),
                                Value::Ptr(q),
                                Value::Ptr(g),
                                Value::I32(ar.n_head as i32),
                                Value::I32(ar.head_dim as i32),
                            ],
                        )?;
                    }
                    (q, k, v, q_dim, kv_dim)
                }
            };
            let bias = |j: usize| opt(ar.qkv_bias.map(|b| b[j]));
            let qk_norm = |j: usize| opt(ar.qk_norm.map(|b| b[j]));
            // rope_rows(_slots)'s arguments: the rows, biases, norms and caches, then where
            // the tokens go (`at`), then the layer's rotation.
            let rope_args = |at_args: &[Value]| {
                let mut a = vec![
                    Value::Ptr(q),
                    Value::Ptr(k),
                    Value::Ptr(v),
                    bias(0),
                    bias(1),
                    bias(2),
                    qk_norm(0),
                    qk_norm(1),
                    Value::Ptr(at.k_cache[l]),
                    Value::Ptr(at.v_cache[l]),
                ];
                a.extend_from_slice(at_args);
                a.extend([
                    Value::I32(ar.n_head as i32),
                    Value::I32(ar.n_head_kv as i32),
                    Value::I32(ar.head_dim as i32),
                    Value::I32(ar.n_dims as i32),
                    Value::I32(i32::from(ar.neox)),
                    Value::F32(crate::schedule::theta_scale(ar.freq_base, ar.n_dims)),
                    Value::F32(ar.freq_scale),
                    opt(ar.freq_factors),
                    eps,
                ]);
                a.extend(ar.rope_scaling.args().map(Value::F32));
                a
            };
            match rows {
                Placement::Prompt { pos0 } => {
                    self.run(
                        "rope_rows",
                        ((ar.n_head + ar.n_head_kv) as u32, n as u32),
                        128,
                        &rope_args(&[Value::I32(pos0 as i32)]),
                    )?;
                    // attn_mma_HD(q, kc, vc, out, pos0, n, n_head, n_head_kv, scale, window);
                    // attn_tile takes the head width before the scale.
                    let mut args = vec![
                        Value::Ptr(q),
                        Value::Ptr(at.k_cache[l]),
                        Value::Ptr(at.v_cache[l]),
                        Value::Ptr(attn),
                        Value::I32(pos0 as i32),
                        Value::I32(n as i32),
                        Value::I32(ar.n_head as i32),
                        Value::I32(ar.n_head_kv as i32),
                    ];
                    let mma = self
                        .tuning
                        .tensor_core_attention
                        .then(|| mma_attention(ar.head_dim))
                        .flatten();
                    let (kernel, tile, threads) = match mma {
                        Some((kernel, queries)) => (kernel, queries, 2 * queries as u32),
                        None => {
                            args.push(Value::I32(ar.head_dim as i32));
                            ("attn_tile", ATTN_TILE, 128)
                        }
                    };
                    args.extend([
                        Value::F32(ar.scale),
                        Value::F32(ar.softcap),
                        Value::I32(ar.window as i32),
                        opt(ar.sinks),
                    ]);
                    self.run(
                        kernel,
                        (ar.n_head as u32, n.div_ceil(tile) as u32),
                        threads,
                        &args,
                    )?;
                }
                Placement::Slots { slot_stride, .. } => {
                    let (slots, pos) = (
                        self.dev.address(&self.row_slots),
                        self.dev.address(&self.row_pos),
                    );
                    self.run(
                        "rope_rows_slots",
                        ((ar.n_head + ar.n_head_kv) as u32, n as u32),
                        128,
                        &rope_args(&[
                            Value::Ptr(slots),
                            Value::Ptr(pos),
                            Value::I64(slot_stride[l] as i64),
                            Value::I32(q_stride as i32),
                            Value::I32(kv_stride as i32),
                        ]),
                    )?;
                    // (an mmq_* output product quantizes the f32 rows, as the CPU does)
                    let quantized = self
                        .quantized_rows(p, &[ar.wo])
                        .filter(|_| !ar.gated_output)
                        .zip(self.attn32.as_ref().map(|b| self.dev.address(b)));
                    self.run(
                        "attn_rows",
                        (ar.n_head as u32, n as u32),
                        128,
                        &[
                            Value::Ptr(q),
                            Value::Ptr(at.k_cache[l]),
                            Value::Ptr(at.v_cache[l]),
                            Value::Ptr(attn),
                            Value::Ptr(slots),
                            Value::Ptr(pos),
                            Value::I64(slot_stride[l] as i64),
                            Value::I32(q_stride as i32),
                            Value::I32(ar.n_head as i32),
                            Value::I32(ar.n_head_kv as i32),
                            Value::I32(ar.head_dim as i32),
                            Value::F32(ar.scale),
                            Value::F32(ar.softcap),
                            Value::I32(ar.window as i32),
                            opt(ar.sinks),
                            Value::Ptr(quantized.map_or(0, |(_, a32)| a32)),
                        ],
                    )?;
                    if let Some(((xq, mode), a32)) = quantized {
                        self.quantize_rows("quantize_rows_f32", a32, (n, q_dim), (xq, mode))?;
                        self.xq_holds = Some((attn, mode));
                    }
                }
            }
            if let Some(b) = self.hybrid.as_ref().filter(|_| ar.gated_output) {
                let (g, total) = (self.dev.address(&b.attn_gate), (n * q_dim) as u64);
                self.run(
                    "sigmoid_mul_f16",
                    (total.div_ceil(256) as u32, 1),
                    256,
                    &[Value::Ptr(attn), Value::Ptr(g), Value::I64(total as i64)],
                )?;
            }
            let end = (r.post_attn_norm, r.residual_scale);
            self.block_output(p, at, (ar.wo, ar.out_bias), attn, n, end)?;
            self.feed_forward(p, at, l, r, n, rows)?;
        }
        Ok(())
    }

    /// Layer `l`'s feed-forward block over the batch's `n` rows, from its norm to the residual
    /// add.
    fn feed_forward(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        l: usize,
        r: &LayerRefs,
        n: usize,
        rows: Placement<'_>,
    ) -> Result<(), CudaError> {
        let d = p.n_embd;
        let h = self.dev.address(&self.h);
        let (gate, up, act) = (
            self.dev.address(&self.gate),
            self.dev.address(&self.up),
            self.dev.address(&self.act),
        );
        let next = if r.moe.is_some() {
            &[][..]
        } else {
            &r.ffn[..2]
        };
        self.norm_rows(p, at.vectors[r.ffn_norm], n, next)?;
        if let Some(m) = &r.moe {
            return self.experts(p, at, (l, r, m), n, rows);
        }
        let [g, u, down] = r.ffn;
        let n_ff = p.matrices[g].rows;
        let total = (n * n_ff) as u64;
        let fused_gu = match rows {
            Placement::Slots { .. } if self.stacks(p, &[g, u]) => {
                self.gate_up_kept.get(l).copied().flatten()
            }
            _ => None,
        };
        let stacked_rows = self.gate_up_rows.as_ref().map(|b| self.dev.address(b));
        match (fused_gu, stacked_rows) {
            (Some(w), Some(out)) => {
                // Gate and up as one stacked matrix: each token's row is (gate | up).
                self.gemm(w, 2 * n_ff, d, h, n, out, 0.0)?;
                self.run(
                    &format!("{}_pairs_f16", r.activation.kernel()),
                    (total.div_ceil(256) as u32, 1),
                    256,
                    &[
                        Value::Ptr(out),
                        Value::Ptr(act),
                        Value::I32(n_ff as i32),
                        Value::I64(total as i64),
                    ],
                )?;
            }
            _ if !self.all_mmq(p, &[down])
                && self.dq_glu(p, at, [g, u], r.activation, (h, n), act)? => {}
            _ => {
                self.products(p, at, &[(g, gate), (u, up)], h, n)?;
                if self.all_mmq(p, &[down]) {
                    self.glu_rows_q(p, r, [gate, up, act], n, down)?;
                } else {
                    self.glu_f16(r, [gate, up, act], total)?;
                }
            }
        }
        self.block_output(
            p,
            at,
            (down, None),
            act,
            n,
            (r.post_ffn_norm, r.residual_scale),
        )
    }

    /// Layer `l`'s gated delta-net over the batch's `n` rows (their f16 norms in `h`): the
    /// projections' GEMMs, then for a prompt `delta_conv_rows_runs` and the chunked delta rule (the
    /// layer's states carried from the batch before, or zeros at position 0), for a batched
    /// step `delta_conv_slots` and `delta_rule_slots` (each row its slot's states); the
    /// read-out in the hybrid buffers' `out` for the output product.
    fn delta_net(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        l: usize,
        dn: &DeltaNetRefs,
        n: usize,
        rows: Placement<'_>,
    ) -> Result<(), CudaError> {
        let b = self
            .hybrid
            .as_ref()
            .expect("a plan with delta-nets has their buffers");
        let addr = |x: &D::Buffer<f32>| self.dev.address(x);
        let (input, z, ba, alpha, conv) = (
            addr(&b.input),
            addr(&b.z),
            addr(&b.ba),
            addr(&b.alpha),
            addr(&b.conv),
        );
        let out = self.dev.address(&b.out);
        let (read_out, gram) = (addr(&b.read_out), addr(&b.gram));
        let h = self.dev.address(&self.h);
        let (s, hk, hv) = (dn.head_dim, dn.n_k_heads, dn.n_v_heads);
        let (key_dim, value_dim, channels) = (hk * s, hv * s, dn.channels());
        let plan_rows = |m: usize| p.matrices[m].rows;
        let (fused, in_stride, z_ptr, z_stride) = match dn.input {
            DeltaNetProjection::Fused(m) => (true, plan_rows(m), 0, plan_rows(m)),
            DeltaNetProjection::Split(_, _) => (false, channels, z, value_dim),
        };
        let (ba_stride, alpha_ptr) = match dn.gates {
            DeltaNetProjection::Fused(_) => (2 * hv, 0),
            DeltaNetProjection::Split(..) => (hv, alpha),
        };
        for (input_m, dst) in [(dn.input, [input, z]), (dn.gates, [ba, alpha])] {
            match input_m {
                DeltaNetProjection::Fused(m) => self.product(p, at, m, h, n, dst[0], 0.0)?,
                DeltaNetProjection::Split(m1, m2) => {
                    self.product(p, at, m1, h, n, dst[0], 0.0)?;
                    self.product(p, at, m2, h, n, dst[1], 0.0)?;
                }
            }
        }
        let [conv_state, ssm_state] = at.states[l];
        let ratio = hv / hk;
        // The kernels' arguments: the input, the weights and state, where the tokens are.
        let conv_in = [
            Value::Ptr(input),
            Value::I32(in_stride as i32),
            Value::I32(i32::from(fused)),
            Value::Ptr(at.vectors[dn.conv]),
            Value::Ptr(conv_state),
        ];
        let conv_shape = [
            Value::I32(channels as i32),
            Value::I32(dn.conv_kernel as i32),
            Value::I32(key_dim as i32),
            Value::I32(s as i32),
            Value::I32(ratio as i32),
        ];
        let rule_in = [
            Value::Ptr(conv),
            Value::Ptr(ba),
            Value::I32(ba_stride as i32),
            Value::Ptr(alpha_ptr),
            Value::Ptr(at.vectors[dn.dt_bias]),
            Value::Ptr(at.vectors[dn.a]),
            Value::Ptr(at.vectors[dn.norm]),
            Value::Ptr(input),
            Value::Ptr(z_ptr),
            Value::I32(z_stride as i32),
            Value::Ptr(ssm_state),
        ];
        let rule_shape = [
            Value::I32(hk as i32),
            Value::I32(hv as i32),
            Value::I32(s as i32),
            Value::I32(i32::from(dn.tiled_key_heads)),
            Value::F32(p.norm_eps),
        ];
        let conv_grid = channels.div_ceil(128) as u32;
        match rows {
            Placement::Prompt { pos0 } => {
                let pos0 = Value::I32(pos0 as i32);
                let mut args = conv_in.to_vec();
                args.extend([pos0, Value::Ptr(conv)]);
                args.extend(conv_shape);
                args.push(Value::I32(n as i32));
                // Runs of at least 16 tokens (the kernel wants taps - 1 at least; the plan
                // caps the taps at 16), at most 64 of them.
                let runs = (n / 16).clamp(1, 64) as u32;
                self.run("delta_conv_rows_runs", (conv_grid, runs), 128, &args)?;
                if s != 64 && s != 128 {
                    let mut args = rule_in.to_vec();
                    args.extend([pos0, Value::Ptr(out)]);
                    args.extend(rule_shape);
                    args.push(Value::I32(n as i32));
                    return self.run("delta_rule_rows", (hv as u32, 1), s as u32, &args);
                }
                // The chunked form: queries and keys normalized in place, each chunk's Gram
                // blocks, the states through the chunks a block per 32 columns, the gated norm.
                let (hk32, s32, channels32) = (hk as i32, s as i32, channels as i32);
                let norm_args = [
                    Value::Ptr(conv),
                    Value::I32(hk32),
                    Value::I32(s32),
                    Value::I32(channels32),
                    Value::F32(p.norm_eps),
                ];
                self.run(
                    "delta_qk_norm_rows",
                    (hk as u32, n as u32),
                    s as u32,
                    &norm_args,
                )?;
                let gram_args = [
                    Value::Ptr(conv),
                    Value::Ptr(gram),
                    Value::I32(hk32),
                    Value::I32(s32),
                    Value::I32(channels32),
                    Value::I32(n as i32),
                ];
                let chunks = n.div_ceil(DELTA_CHUNK) as u32;
                self.run("delta_chunk_gram", (hk as u32, chunks), 256, &gram_args)?;
                let mut args = rule_in[..6].to_vec();
                args.extend([
                    Value::Ptr(gram),
                    Value::Ptr(ssm_state),
                    pos0,
                    Value::Ptr(read_out),
                    Value::I32(hk32),
                    Value::I32(hv as i32),
                    Value::I32(s32),
                    Value::I32(i32::from(dn.tiled_key_heads)),
                    Value::I32(n as i32),
                ]);
                self.run(
                    "delta_rule_chunks",
                    (hv as u32, (s / 32) as u32),
                    256,
                    &args,
                )?;
                let norm_args = [
                    Value::Ptr(read_out),
                    Value::Ptr(input),
                    Value::Ptr(z_ptr),
                    Value::I32(z_stride as i32),
                    Value::Ptr(at.vectors[dn.norm]),
                    Value::Ptr(out),
                    Value::I32(hv as i32),
                    Value::I32(s32),
                    Value::I32(ratio as i32),
                    Value::F32(p.norm_eps),
                ];
                self.run(
                    "delta_gated_norm_rows",
                    (hv as u32, n as u32),
                    s as u32,
                    &norm_args,
                )
            }
            Placement::Slots { .. } => {
                let [conv_floats, ssm_floats] = [dn.conv_state(), dn.ssm_state()];
                let (slots, pos) = (
                    self.dev.address(&self.row_slots),
                    self.dev.address(&self.row_pos),
                );
                let mut args = conv_in.to_vec();
                args.extend([
                    Value::I64(conv_floats as i64),
                    Value::Ptr(slots),
                    Value::Ptr(pos),
                    Value::Ptr(conv),
                ]);
                args.extend(conv_shape);
                self.run("delta_conv_slots", (conv_grid, n as u32), 128, &args)?;
                let mut args = rule_in.to_vec();
                args.extend([
                    Value::I64(ssm_floats as i64),
                    Value::Ptr(slots),
                    Value::Ptr(pos),
                    Value::Ptr(out),
                ]);
                args.extend(rule_shape);
                self.run("delta_rule_slots", (hv as u32, n as u32), s as u32, &args)
            }
        }
    }

    /// Layer `r`'s mixture of experts over the batch's `n` rows (their f16 norms in `h`),
    /// into the residual stream: the router's GEMM and each token's routing on the device;
    /// then for a prompt the (token, slot) pairs grouped by expert (the counts read back, a
    /// sync per layer) and each used expert's three products one GEMM over its rows, or for a
    /// batched decode step (captured as a graph: no sync) each pair's products as the decode
    /// step's kernels compute them; the shared expert's GEMMs; the weighted sum.
    fn experts(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        (l, r, m): (usize, &LayerRefs, &MoeRefs),
        n: usize,
        rows: Placement<'_>,
    ) -> Result<(), CudaError> {
        // (out of self while the CPU works beside the launches; back whatever happens)
        let mut share = match &self.cpu_share {
            Some(s) if s.serves(l) => self.cpu_share.take(),
            _ => None,
        };
        let done = self.experts_sharing(p, at, (l, r, m), n, rows, share.as_mut());
        if share.is_some() {
            self.cpu_share = share;
        }
        done
    }

    /// [`Prefill::experts`], the groups of the last experts computed by `share` (a batched
    /// decode step's rows grouped as a prompt's then).
    fn experts_sharing(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        (l, r, m): (usize, &LayerRefs, &MoeRefs),
        n: usize,
        rows: Placement<'_>,
        mut share: Option<&mut PromptCpuShare>,
    ) -> Result<(), CudaError> {
        let (d, ne, k, ff) = (p.n_embd, m.n_expert, m.n_used, m.n_ff);
        let pairs = n * k;
        let b = self
            .moe
            .as_ref()
            .expect("allocated for a plan with experts");
        let (logits, ids, weights) = (
            self.dev.address(&b.logits),
            self.dev.address(&b.ids),
            self.dev.address(&b.weights),
        );
        let (counts, offsets, at_rows) = (
            self.dev.address(&b.counts),
            self.dev.address(&b.offsets),
            self.dev.address(&b.at),
        );
        let (gathered, outputs, normed) = (
            self.dev.address(&b.gathered),
            self.dev.address(&b.outputs),
            self.dev.address(&b.normed),
        );
        let (shared_out, shared_gate) = (
            self.dev.address(&b.shared_out),
            self.dev.address(&b.shared_gate),
        );
        let (x, h, gate, up, act) = (
            self.dev.address(&self.x),
            self.dev.address(&self.h),
            self.dev.address(&self.gate),
            self.dev.address(&self.up),
            self.dev.address(&self.act),
        );
        let opt = |i: Option<usize>| Value::Ptr(i.map_or(0, |i| at.vectors[i]));
        let router = &p.matrices[m.router];
        if router.ty == TensorType::F32 {
            // An f32 router multiplies the f32 norms, as the CPU does: f16 inputs would change
            // which experts a near tie picks.
            self.norm_rows_f32(at.vectors[r.ffn_norm], normed, n, p)?;
            self.dev.gemm(Gemm {
                w16: at.matrices[m.router],
                rows: router.rows,
                cols: router.cols,
                a: normed,
                n,
                c: logits,
                beta: 0.0,
                f32_operands: true,
                batch: 1,
            })?;
        } else {
            self.product(p, at, m.router, h, n, logits, 0.0)?;
        }
        let biases = m
            .biases
            .map(|(router, experts)| (at.vectors[router], experts.map(|v| at.vectors[v])));
        if let Some((router, _)) = biases {
            self.add_bias_rows(logits, router, ne, n)?;
        }
        self.run(
            "moe_route",
            (n as u32, 1),
            ne.next_multiple_of(32) as u32,
            &[
                Value::Ptr(logits),
                opt(m.selection_bias),
                Value::Ptr(ids),
                Value::Ptr(weights),
                Value::I32(ne as i32),
                Value::I32(k as i32),
                Value::I32(m.gating),
                Value::I32(m.groups.0 as i32),
                Value::I32(m.groups.1 as i32),
                Value::I32(i32::from(m.norm_weights)),
                Value::F32(m.weights_scale),
                Value::Ptr(at.expert_counts[l]),
                Value::Ptr(match rows {
                    Placement::Slots { .. } => self.dev.address(&self.row_slots),
                    Placement::Prompt { .. } => 0,
                }),
                Value::I32(match rows {
                    Placement::Slots { spare, .. } => spare as i32,
                    Placement::Prompt { .. } => 0,
                }),
            ],
        )?;
        let [wg, wu, wd] = m.experts;
        let grouped = matches!(rows, Placement::Prompt { .. }) || share.is_some();
        if grouped {
            // (the CPU multiplies the f32 norms, as its forward pass does)
            if share.is_some() && router.ty != TensorType::F32 {
                self.norm_rows_f32(at.vectors[r.ffn_norm], normed, n, p)?;
            }
            let group = if ne <= 1024 {
                "moe_group_warp"
            } else {
                "moe_group"
            };
            self.run(
                group,
                (1, 1),
                32,
                &[
                    Value::Ptr(ids),
                    Value::I32(pairs as i32),
                    Value::I32(ne as i32),
                    Value::Ptr(counts),
                    Value::Ptr(offsets),
                    Value::Ptr(at_rows),
                ],
            )?;
            let mut used = vec![0u32; ne];
            let b = self.moe.as_ref().expect("allocated");
            self.dev
                .download(&b.counts, &mut used, "reading the experts' counts")?;
            if let Some(s) = share.as_deref_mut() {
                s.prepare(n, k, d);
                self.dev
                    .download(&b.ids, &mut s.ids, "the CPU's chosen experts")?;
                self.dev.download(&b.at, &mut s.at, "the CPU's groups")?;
                self.dev
                    .download(&b.normed, &mut s.normed, "the CPU's inputs")?;
            }
            self.dev.synchronize("reading the experts' counts")?;
            // Every expert's group padded to the largest, where that fits twice the pairs: one
            // strided-batched GEMM per matrix over all the (GPU's) experts (a GEMM each
            // otherwise, or without `CudaTuning::padded_expert_groups`).
            let most = used.iter().copied().max().unwrap_or(0) as usize;
            let padded = self.tuning.padded_expert_groups && most > 0 && ne * most <= 2 * pairs;
            // Experts `cpu.first..` on the CPU, their rows from `cpu.row` on.
            let cpu = (share.as_deref_mut()).map(|s| s.split(&used, padded.then_some(most)));
            let gpu_experts = cpu.map_or(ne, |c| c.first);
            if padded {
                self.run(
                    "moe_pad_rows",
                    (pairs.div_ceil(256) as u32, 1),
                    256,
                    &[
                        Value::Ptr(ids),
                        Value::Ptr(offsets),
                        Value::Ptr(at_rows),
                        Value::I32(pairs as i32),
                        Value::I32(most as i32),
                    ],
                )?;
            }
            self.run(
                "moe_gather_f16",
                (pairs as u32, 1),
                128,
                &[
                    Value::Ptr(h),
                    Value::Ptr(at_rows),
                    Value::I32(k as i32),
                    Value::I32(d as i32),
                    Value::Ptr(gathered),
                ],
            )?;
            // Each used expert's group: (expert, first row, rows).
            let groups: Vec<(usize, usize, usize)> = used
                .iter()
                .scan(0usize, |o, &c| {
                    let g = (*o, c as usize);
                    *o += c as usize;
                    Some(g)
                })
                .enumerate()
                .filter(|&(e, (_, c))| c > 0 && e < gpu_experts)
                .map(|(e, (o, c))| if padded { (e, e * most, c) } else { (e, o, c) })
                .collect();
            // Stacks in host memory dequantized expert by expert where a batched step uses
            // few of the GPU's (each expert's rows cross the bus once either way).
            let sparse = cpu.is_some() && 4 * groups.len() < 3 * gpu_experts;
            let each = |this: &mut Prefill<D>,
                        mat: usize,
                        (rows_out, cols): (usize, usize),
                        input: u64,
                        out: u64,
                        bias: Option<u64>|
             -> Result<(), CudaError> {
                if groups.is_empty() {
                    return Ok(());
                }
                let spec = &p.matrices[mat];
                let kept = this.w16_kept.get(mat).copied().flatten();
                let w16 = if spec.ty == TensorType::F16 {
                    at.matrices[mat]
                } else if let Some(w) = kept {
                    w
                } else {
                    let dst = this.dev.address(&this.w16);
                    if sparse {
                        // (the used experts alone, each at its place)
                        let one = MatrixSpec {
                            rows: rows_out,
                            ..spec.clone()
                        };
                        for &(e, _, _) in &groups {
                            let from = at.matrices[mat] + e as u64 * spec.expert_bytes();
                            this.dequantize(&one, from, dst + 2 * (e * rows_out * cols) as u64)?;
                        }
                    } else {
                        // (the GPU's experts only: their rows come first)
                        let gpu_part = MatrixSpec {
                            rows: gpu_experts * rows_out,
                            ..spec.clone()
                        };
                        this.dequantize(&gpu_part, at.matrices[mat], dst)?;
                    }
                    dst
                };
                if padded {
                    this.dev.gemm(Gemm {
                        w16,
                        rows: rows_out,
                        cols,
                        a: input,
                        n: most,
                        c: out,
                        beta: 0.0,
                        f32_operands: false,
                        batch: gpu_experts,
                    })?;
                }
                for &(e, o, c) in &groups {
                    let y = out + (4 * o * rows_out) as u64;
                    if !padded {
                        let w = w16 + 2 * (e * rows_out * cols) as u64;
                        let a = input + (2 * o * cols) as u64;
                        this.gemm(w, rows_out, cols, a, c, y, 0.0)?;
                    }
                    // (the expert's bias, gpt-oss)
                    if let Some(bias) = bias {
                        this.add_bias_rows(y, bias + (4 * e * rows_out) as u64, rows_out, c)?;
                    }
                }
                Ok(())
            };
            let [gb, ub, db] = biases.map(|(_, e)| e.map(Some)).unwrap_or_default();
            let rows = match cpu {
                Some(c) => c.row,
                None if padded => ne * most,
                None => pairs,
            };
            let gpu_side = |this: &mut Prefill<D>| -> Result<(), CudaError> {
                each(this, wg, (ff, d), gathered, gate, gb)?;
                each(this, wu, (ff, d), gathered, up, ub)?;
                if rows > 0 {
                    this.glu_f16(r, [gate, up, act], (rows * ff) as u64)?;
                }
                each(this, wd, (d, ff), act, outputs, db)
            };
            match (share, cpu) {
                (Some(s), Some(split)) => {
                    // Both sides at once: the GPU's launches queued while the CPU computes.
                    let (gpu, cpu) = std::thread::scope(|scope| {
                        let worker = scope.spawn(|| s.compute(l, k, split));
                        let gpu = gpu_side(self);
                        (gpu, worker.join())
                    });
                    gpu?;
                    cpu.map_err(|_| {
                        CudaError::Model("the CPU tier's prompt worker panicked".into())
                    })??;
                    s.adapt(self.dev.idle()?, ne);
                    let b = self.moe.as_mut().expect("allocated");
                    let rows = s.output()?;
                    if !rows.is_empty() {
                        self.dev.upload_at(
                            rows,
                            &mut b.outputs,
                            split.row * d,
                            "the CPU's expert outputs",
                        )?;
                    }
                }
                _ => gpu_side(self)?,
            }
        } else {
            // Each pair's products as the decode step computes them, from the f32 norms.
            if router.ty != TensorType::F32 {
                self.norm_rows_f32(at.vectors[r.ffn_norm], normed, n, p)?;
            }
            let per_pair = |this: &mut Prefill<D>,
                            mat: usize,
                            rows_out: usize,
                            (input, stride, per): (u64, usize, usize),
                            out: u64| {
                let spec = &p.matrices[mat];
                let (rb, cols) = (spec.row_bytes(), spec.cols);
                let kernel = expert_product_kernel(spec, this.tuning.quantized_activations);
                this.run(
                    &kernel,
                    (rows_out.div_ceil(MATVEC_ROWS) as u32, pairs as u32),
                    this.tuning.matvec_threads(cols / 32, rows_out * pairs),
                    &[
                        Value::Ptr(at.matrices[mat]),
                        Value::I64((rows_out * rb) as i64),
                        Value::I32(rb as i32),
                        Value::I32((cols / 32) as i32),
                        Value::I32(rows_out as i32),
                        Value::Ptr(input),
                        Value::I32(stride as i32),
                        Value::I32(per as i32),
                        Value::Ptr(ids),
                        Value::Ptr(out),
                        // (no shared expert in the grid)
                        Value::Ptr(0),
                        Value::Ptr(0),
                        Value::Ptr(0),
                        Value::I32(0),
                        Value::I32(0),
                    ],
                )
            };
            per_pair(self, wg, ff, (normed, d, k), gate)?;
            per_pair(self, wu, ff, (normed, d, k), up)?;
            // (each pair's expert's biases, gpt-oss)
            let expert_bias = |this: &mut Prefill<D>, y: u64, bias: u64, rows_out: usize| {
                this.run(
                    "moe_add_bias",
                    (rows_out.div_ceil(256) as u32, pairs as u32),
                    256,
                    &[
                        Value::Ptr(y),
                        Value::Ptr(bias),
                        Value::Ptr(ids),
                        Value::I32(rows_out as i32),
                    ],
                )
            };
            if let Some((_, [gb, ub, _])) = biases {
                expert_bias(self, gate, gb, ff)?;
                expert_bias(self, up, ub, ff)?;
            }
            let total = pairs * ff;
            self.run(
                r.activation.kernel(),
                (total.div_ceil(256) as u32, 1),
                256,
                &[
                    Value::Ptr(gate),
                    Value::Ptr(up),
                    Value::Ptr(gate),
                    Value::I32(total as i32),
                ],
            )?;
            per_pair(self, wd, d, (gate, ff, 1), outputs)?;
            if let Some((_, [_, _, db])) = biases {
                expert_bias(self, outputs, db, d)?;
            }
        }
        // The shared expert over every row, as a dense block's GEMMs.
        let (mut sh_out, mut sh_gate) = (0u64, 0u64);
        if let Some(sh) = &m.shared {
            self.product(p, at, sh.gate, h, n, gate, 0.0)?;
            self.product(p, at, sh.up, h, n, up, 0.0)?;
            self.glu_f16(r, [gate, up, act], (n * sh.n_ff) as u64)?;
            self.product(p, at, sh.down, act, n, shared_out, 0.0)?;
            sh_out = shared_out;
            if let Some(gi) = sh.gate_inp {
                self.product(p, at, gi, h, n, shared_gate, 0.0)?;
                sh_gate = shared_gate;
            }
        }
        self.run(
            "moe_combine",
            (d.div_ceil(256) as u32, n as u32),
            256,
            &[
                Value::Ptr(outputs),
                Value::Ptr(weights),
                Value::I32(k as i32),
                Value::I32(d as i32),
                Value::Ptr(sh_out),
                Value::Ptr(sh_gate),
                Value::Ptr(x),
                Value::Ptr(if grouped { at_rows } else { 0 }),
                Value::Ptr(0),
                Value::Ptr(0),
            ],
        )
    }

    /// `rows` rows of `d` f32 values at `y` each plus the bias `d` values at `bias`.
    fn add_bias_rows(&mut self, y: u64, bias: u64, d: usize, rows: usize) -> Result<(), CudaError> {
        let total = (d * rows) as u64;
        self.run(
            "add_bias_rows",
            (total.div_ceil(256) as u32, 1),
            256,
            &[
                Value::Ptr(y),
                Value::Ptr(bias),
                Value::I32(d as i32),
                Value::I64(total as i64),
            ],
        )
    }

    /// The residual stream's `n` rows normed by `weight` into `h` (f16), and, where the
    /// products `next` all go through `mmq_*`, quantized from f32 for them too.
    fn norm_rows(
        &mut self,
        p: &DecodePlan,
        weight: u64,
        n: usize,
        next: &[usize],
    ) -> Result<(), CudaError> {
        let (x, h) = (self.dev.address(&self.x), self.dev.address(&self.h));
        let mut args = vec![Value::Ptr(x), Value::Ptr(weight), Value::Ptr(h)];
        let quantized = self.quantized_rows(p, next);
        let Some((xq, mode)) = quantized else {
            args.extend([Value::I32(p.n_embd as i32), Value::F32(p.norm_eps)]);
            return self.run("rms_norm_rows", (n as u32, 1), 256, &args);
        };
        args.extend([
            Value::Ptr(xq),
            Value::I32(p.n_embd as i32),
            Value::F32(p.norm_eps),
            Value::I32(mode),
        ]);
        let warps = p.n_embd.div_ceil(256).clamp(1, 32) as u32;
        self.run("rms_norm_rows_q", (n as u32, 1), 32 * warps, &args)?;
        self.xq_holds = Some((h, mode));
        Ok(())
    }

    /// The quantized rows' address and activation format when products `ms` (at least one)
    /// all go through `mmq_*` in the step being launched.
    fn quantized_rows(&self, p: &DecodePlan, ms: &[usize]) -> Option<(u64, i32)> {
        let first = *ms.first()?;
        let xq = self.xq_rows.as_ref()?;
        let mode = activation_format(p.matrices[first].ty)?;
        let same = ms
            .iter()
            .all(|&m| activation_format(p.matrices[m].ty) == Some(mode));
        (self.all_mmq(p, ms) && same).then(|| (self.dev.address(xq), mode))
    }

    /// `out = act(gate) * up` as f16 over the `n` rows, quantized from f32 for the `mmq_*`
    /// product `down` too.
    fn glu_rows_q(
        &mut self,
        p: &DecodePlan,
        r: &LayerRefs,
        [g, u, out]: [u64; 3],
        n: usize,
        down: usize,
    ) -> Result<(), CudaError> {
        let (xq, mode) = self
            .quantized_rows(p, &[down])
            .expect("called for an mmq product");
        let ff = p.matrices[down].cols;
        self.run(
            "glu_rows_q",
            (ff.div_ceil(2048) as u32, n as u32),
            256,
            &[
                Value::Ptr(g),
                Value::Ptr(u),
                Value::Ptr(out),
                Value::Ptr(xq),
                Value::I32(ff as i32),
                Value::I32(r.activation.code()),
                Value::I32(mode),
            ],
        )?;
        self.xq_holds = Some((out, mode));
        Ok(())
    }

    /// `out = act(gate) * up` as f16 over `total` values, `r`'s activation.
    fn glu_f16(
        &mut self,
        r: &LayerRefs,
        [g, u, out]: [u64; 3],
        total: u64,
    ) -> Result<(), CudaError> {
        self.run(
            &format!("{}_f16", r.activation.kernel()),
            (total.div_ceil(256) as u32, 1),
            256,
            &[
                Value::Ptr(g),
                Value::Ptr(u),
                Value::Ptr(out),
                Value::I64(total as i64),
            ],
        )
    }

    /// A block's output `W input (+ bias)` over `n` rows into the residual stream: added by
    /// the GEMM itself, or, with a post-norm (Gemma), a residual scale (Granite) or a bias
    /// (gpt-oss's attention output), written to `gate` and added by `post_norm_add`.
    fn block_output(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        (m, bias): (usize, Option<usize>),
        input: u64,
        n: usize,
        (post_norm, scale): (Option<usize>, f32),
    ) -> Result<(), CudaError> {
        let x = self.dev.address(&self.x);
        if post_norm.is_none() && scale == 1.0 && bias.is_none() {
            return self.product(p, at, m, input, n, x, 1.0);
        }
        let y = self.dev.address(&self.gate);
        self.product(p, at, m, input, n, y, 0.0)?;
        if let Some(b) = bias {
            self.add_bias_rows(y, at.vectors[b], p.n_embd, n)?;
        }
        self.run(
            "post_norm_add",
            (n as u32, 1),
            256,
            &[
                Value::Ptr(y),
                Value::Ptr(post_norm.map_or(0, |w| at.vectors[w])),
                Value::Ptr(x),
                Value::I32(p.n_embd as i32),
                Value::F32(p.norm_eps),
                Value::F32(scale),
            ],
        )
    }

    /// The final soft cap and the logit scale over `count` logits at `logits`, where the
    /// model has them.
    fn adjust_logits(
        &mut self,
        p: &DecodePlan,
        logits: u64,
        count: usize,
    ) -> Result<(), CudaError> {
        if p.logits.is_none() {
            return Ok(());
        }
        let [inv_cap, cap, inv_scale] = p.logits.args();
        self.run(
            "adjust_logits",
            ((count as u64).div_ceil(256) as u32, 1),
            256,
            &[
                Value::Ptr(logits),
                Value::I64(count as i64),
                Value::F32(inv_cap),
                Value::F32(cap),
                Value::F32(inv_scale),
            ],
        )
    }

    /// One decode step of several sequences: `ids[t]` of slot `slots[t]` at position
    /// `pos[t]` (at most [`MAX_BATCH`] tokens, each slot at most once), every matrix read once
    /// for all of them (GEMMs), attention per token over its own slot's cache. Returns every
    /// row's logits, each row's greedy choice, or each row's largest logits (the logits then
    /// stay on the device). Needs the whole model.
    ///
    /// The step is padded to a power of two of rows, the padding's keys and values written to
    /// slot `spare` (a slot no sequence uses), and replayed from a CUDA graph per padded size
    /// after its first run (which runs launch by launch and warms cuBLAS up).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_rows(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        ids: &[u32],
        slots: &[u32],
        pos: &[u32],
        slot_stride: &[usize],
        spare: u32,
        want: RowsWant,
    ) -> Result<Rows, CudaError> {
        let n = ids.len();
        assert!(
            n == slots.len() && n == pos.len(),
            "one slot and position per id"
        );
        let bucket = n.next_power_of_two().min(MAX_BATCH);
        let pad = |v: &[u32], with: u32| {
            let mut v = v.to_vec();
            v.resize(bucket, with);
            v
        };
        let dev = &self.dev;
        dev.upload(&pad(ids, 0), &mut self.ids, "uploading the ids")?;
        dev.upload(
            &pad(slots, spare),
            &mut self.row_slots,
            "uploading the slots",
        )?;
        dev.upload(&pad(pos, 0), &mut self.row_pos, "uploading the positions")?;
        if self.all_logits.is_none() {
            self.all_logits = Some(
                self.dev
                    .alloc_zeros::<f32>(MAX_BATCH * p.n_vocab, "logits of every row")?,
            );
        }
        let replay = self.graphs && !self.dev.profiling();
        match self.row_graphs.get(&bucket) {
            Some(Some(graph)) if replay => {
                self.dev.launch_graph(graph)?;
            }
            Some(None) if replay => {
                // Seen once: capture it now and replay it from here on.
                self.dev.begin_capture()?;
                let launched = self.launch_rows(p, at, bucket, (slot_stride, spare));
                let graph = self.dev.end_capture();
                match (launched, graph) {
                    (Ok(()), Ok(Some(graph))) => {
                        self.dev.upload_graph(&graph)?;
                        self.dev.launch_graph(&graph)?;
                        self.row_graphs.insert(bucket, Some(graph));
                    }
                    (launched, graph) => {
                        // Launch by launch from now on; say why once.
                        let why = launched
                            .err()
                            .map(|e| e.to_string())
                            .or_else(|| graph.err().map(|e| e.to_string()));
                        eprintln!(
                            "ferrolm: the batched decode step could not be captured ({}); launching it kernel by kernel",
                            why.unwrap_or_else(|| "empty capture".into())
                        );
                        self.graphs = false;
                        self.launch_rows(p, at, bucket, (slot_stride, spare))?;
                    }
                }
            }
            _ => {
                self.row_graphs.insert(bucket, None);
                self.launch_rows(p, at, bucket, (slot_stride, spare))?;
            }
        }
        self.after_rows(p, n, want)
    }

    /// What `want` asks of the `n` rows of logits a step left on the device.
    fn after_rows(&mut self, p: &DecodePlan, n: usize, want: RowsWant) -> Result<Rows, CudaError> {
        let vocab = p.n_vocab;
        let logits = self
            .dev
            .address(self.all_logits.as_ref().expect("allocated"));
        match want {
            RowsWant::Greedy => {
                let out_ids = self.dev.address(&self.row_ids);
                self.run(
                    "argmax_rows",
                    (n as u32, 1),
                    1024,
                    &[
                        Value::Ptr(logits),
                        Value::I32(vocab as i32),
                        Value::Ptr(out_ids),
                    ],
                )?;
                let mut chosen = vec![0u32; n];
                self.dev
                    .download(&self.row_ids, &mut chosen, "reading the choices")?;
                self.dev.synchronize("reading the choices")?;
                Ok(Rows::Greedy(chosen))
            }
            RowsWant::Top(k) => {
                let k = k.clamp(1, TOP_MAX.min(vocab));
                let (ids, vals) = (
                    self.dev.address(&self.top_ids),
                    self.dev.address(&self.top_vals),
                );
                self.run(
                    "topk_rows",
                    (n as u32, 1),
                    1024,
                    &[
                        Value::Ptr(logits),
                        Value::I32(vocab as i32),
                        Value::I32(k as i32),
                        Value::Ptr(ids),
                        Value::Ptr(vals),
                    ],
                )?;
                let mut top_ids = vec![0u32; n * k];
                let mut top_vals = vec![0f32; n * k];
                self.dev
                    .download(&self.top_ids, &mut top_ids, "reading the candidates")?;
                self.dev
                    .download(&self.top_vals, &mut top_vals, "reading the candidates")?;
                self.dev.synchronize("reading the candidates")?;
                Ok(Rows::Top(
                    top_ids
                        .chunks_exact(k)
                        .zip(top_vals.chunks_exact(k))
                        .map(|(i, v)| i.iter().copied().zip(v.iter().copied()).collect())
                        .collect(),
                ))
            }
            RowsWant::Logits => {
                let mut out = vec![0f32; n * vocab];
                let all_logits = self.all_logits.as_ref().expect("allocated");
                self.dev
                    .download(all_logits, &mut out, "reading the logits")?;
                self.dev.synchronize("reading the logits")?;
                Ok(Rows::Logits(out))
            }
        }
    }

    /// The device's selections over rows the host gives (`n_vocab` values each): every row's
    /// greedy choice and its `k` largest (id, value), as a batched step makes them, so that a
    /// check can compare them with the host's on the very same values.
    pub fn select_rows(
        &mut self,
        p: &DecodePlan,
        rows: &[f32],
        k: usize,
    ) -> Result<crate::device::Selections, CudaError> {
        let vocab = p.n_vocab;
        let n = rows.len() / vocab;
        assert!(
            n <= MAX_BATCH && n * vocab == rows.len(),
            "whole rows, at most MAX_BATCH"
        );
        if self.all_logits.is_none() {
            self.all_logits = Some(
                self.dev
                    .alloc_zeros::<f32>(MAX_BATCH * vocab, "logits of every row")?,
            );
        }
        let all = self.all_logits.as_mut().expect("allocated");
        self.dev.upload(rows, all, "uploading rows")?;
        let greedy = match self.after_rows(p, n, RowsWant::Greedy)? {
            Rows::Greedy(g) => g,
            _ => unreachable!("greedy asked for"),
        };
        let top = match self.after_rows(p, n, RowsWant::Top(k))? {
            Rows::Top(t) => t,
            _ => unreachable!("candidates asked for"),
        };
        Ok((greedy, top))
    }

    /// The launches of a batched decode step of `n` rows already uploaded: the layers and the
    /// output head over every row (the graph of a step size; the choices come after it).
    fn launch_rows(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        n: usize,
        (slot_stride, spare): (&[usize], u32),
    ) -> Result<(), CudaError> {
        self.mmq_step = self.xq_rows.is_some() && n <= self.tuning.mmq_max_rows;
        self.dq_step = n <= self.tuning.dq_gemm_max_rows.min(DQ_MAX_ROWS);
        self.xq_holds = None;
        let launched = self
            .launch_layers(p, at, n, Placement::Slots { slot_stride, spare })
            .and_then(|()| self.logits_rows(p, at, n).map(|_| ()));
        self.mmq_step = false;
        self.dq_step = false;
        self.xq_holds = None;
        launched
    }

    /// The output head over the `n` rows of the residual stream: their logits in
    /// `all_logits` (allocated here on first use, so before any capture), whose address it
    /// returns.
    fn logits_rows(&mut self, p: &DecodePlan, at: &Addresses, n: usize) -> Result<u64, CudaError> {
        let head = p
            .head
            .ok_or_else(|| CudaError::Model("the output head is on the CPU".into()))?;
        if self.all_logits.is_none() {
            self.all_logits = Some(
                self.dev
                    .alloc_zeros::<f32>(MAX_BATCH * p.n_vocab, "logits of every row")?,
            );
        }
        let h = self.dev.address(&self.h);
        let logits = self
            .dev
            .address(self.all_logits.as_ref().expect("allocated"));
        self.norm_rows(p, at.vectors[head.out_norm], n, &[head.output])?;
        self.product(p, at, head.output, h, n, logits, 0.0)?;
        self.adjust_logits(p, logits, n * p.n_vocab)?;
        Ok(logits)
    }

    /// Evaluates `ids` at positions `pos0..` (at most [`MAX_BATCH`]): the KV cache gets their
    /// keys and values and the last token's greedy choice goes to the token buffer. With
    /// `all`, returns every position's logits; otherwise the last token's logits go to the
    /// decode step's logits buffer. A plan of the first layers only returns the residual
    /// stream of every token instead (`n_embd` each). Only the `last` batch of a prompt
    /// chooses a token (a sampler draws once per prompt, as the host's does) and, without
    /// `all`, computes logits.
    #[allow(clippy::too_many_arguments)]
    pub fn eval(
        &mut self,
        p: &DecodePlan,
        at: &Addresses,
        ids: &[u32],
        pos0: usize,
        all: bool,
        last: bool,
    ) -> Result<Vec<f32>, CudaError> {
        self.layers(p, at, ids, Placement::Prompt { pos0 })?;
        let n = ids.len();
        let d = p.n_embd;
        let eps = Value::F32(p.norm_eps);
        let x = self.dev.address(&self.x);
        let Some(head) = p.head else {
            // The first layers only: the residual stream goes on on the CPU.
            let mut hidden = vec![0f32; n * d];
            self.dev
                .download(&self.x, &mut hidden, "reading the residual stream")?;
            return Ok(hidden);
        };
        let vocab = p.n_vocab;
        let mut out = Vec::new();
        if all {
            let logits = self.logits_rows(p, at, n)?;
            out = vec![0f32; n * vocab];
            let all_logits = self.all_logits.as_ref().expect("allocated");
            self.dev
                .download(all_logits, &mut out, "reading the logits")?;
            // The choice from the last row (the caller copies it to the step's logits).
            if last {
                let last_row = logits + (4 * (n - 1) * vocab) as u64;
                self.choose(at, last_row, vocab)?;
            }
            return Ok(out);
        } else if !last {
            return Ok(out);
        } else {
            // The last token only: its norm (f32) and the output matrix-vector product.
            let normed = self.dev.address(&self.last);
            self.run(
                "rms_norm",
                (1, 1),
                1024,
                &[
                    Value::Ptr(x + (4 * (n - 1) * d) as u64),
                    Value::Ptr(at.vectors[head.out_norm]),
                    Value::Ptr(normed),
                    Value::I32(d as i32),
                    eps,
                ],
            )?;
            let spec = &p.matrices[head.output];
            let chunks = spec.cols / 32;
            self.run(
                &format!("matvec_{}", spec.kernel),
                (spec.rows.div_ceil(MATVEC_ROWS) as u32, 1),
                self.tuning.matvec_threads(chunks, spec.rows),
                &[
                    Value::Ptr(at.matrices[head.output]),
                    Value::I32(spec.row_bytes() as i32),
                    Value::I32(chunks as i32),
                    Value::I32(spec.rows as i32),
                    Value::Ptr(normed),
                    Value::Ptr(0),
                    Value::Ptr(0),
                    Value::Ptr(at.logits),
                ],
            )?;
            self.adjust_logits(p, at.logits, vocab)?;
        }
        self.choose(at, at.logits, vocab)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tensor_core_attention_kernels_are_in_the_source() {
        let src = crate::kernels::SOURCE.as_str();
        assert!(src.contains("void __launch_bounds__(2 * FQ)"));
        for hd in [64, 128, 256] {
            let (name, queries) = mma_attention(hd).expect("served");
            let width = name.strip_prefix("attn_mma_").expect("name");
            assert_eq!(width, hd.to_string());
            assert!(
                src.contains(&format!("\nATTN_MMA({hd}, {queries}, ")),
                "{name}"
            );
        }
        // Other widths take the f32 tiles.
        assert_eq!(mma_attention(80), None);
        assert_eq!(mma_attention(96), None);
    }

    #[test]
    fn the_pipelined_q4k_products_cover_every_super_block_once() {
        let src = crate::kernels::SOURCE.as_str();
        for (warps, stages) in DQ_PIPES {
            for most in [8, 16] {
                let name = format!("dq4k_pipe_{most}_{warps}x{stages}");
                let def = format!("DQ_PIPE({name}, PipeQ4K, {}, {warps}, {stages})", most / 8);
                assert!(src.contains(&def), "{def}");
            }
            // An 8B's shapes, a 1B's, and small ones.
            for (rows, n_sb) in [
                (4096, 16),
                (1024, 16),
                (28672, 16),
                (4096, 56),
                (300, 1),
                (64, 3),
            ] {
                let (row_blocks, runs, run) = dq_pipe_grid(rows, n_sb, warps);
                assert!(row_blocks * 32 * warps >= rows && (row_blocks - 1) * 32 * warps < rows);
                // Every run holds super-blocks, and the runs hold them all.
                assert!(
                    runs * run >= n_sb && (runs - 1) * run < n_sb,
                    "{rows} {n_sb}"
                );
                // Few row blocks split their columns, many do not.
                assert!(runs == 1 || row_blocks * runs <= DQ_PIPE_BLOCKS);
                assert!(runs > 1 || row_blocks * 2 > DQ_PIPE_BLOCKS || n_sb == 1);
            }
            // Within the 227 KiB an H100 or H200 block may have.
            assert!(dq_pipe_shared(DQ4K_STAGE_ROW, warps, stages, 2) <= 227 << 10);
        }
        // Two Q6_K blocks an SM.
        let (warps, stages) = DQ6_PIPE;
        assert!(2 * (dq_pipe_shared(DQ6K_STAGE_ROW, warps, stages, 2) + 1024) <= 228 << 10);
        for most in [8, 16] {
            let def = format!(
                "DQ_PIPE(dq6k_pipe_{most}, PipeQ6K, {}, {warps}, {stages})",
                most / 8
            );
            assert!(src.contains(&def), "{def}");
        }
        assert_eq!(dq_pipe_grid(4096, 16, 4), (32, 8, 2));
        assert_eq!(dq_pipe_grid(28672, 16, 4), (224, 1, 16));
    }
}
