//! The CUDA backend's switches and sizes. The defaults are what measured fastest
//! (docs/PERFORMANCE.md); the others exist to compare variants on a GPU machine. Library code
//! takes them as a value ([`crate::CudaOptions::tuning`]); only [`CudaTuning::from_env`], which
//! the `ferrolm` binary calls, reads the `FERROLM_CUDA_*` variables.

use std::path::PathBuf;

/// How the CUDA backend builds and runs its steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaTuning {
    /// Decode steps (and batched steps) replayed from CUDA graphs (`FERROLM_CUDA_NO_GRAPH`
    /// unsets it: kernel by kernel).
    pub graphs: bool,
    /// Prompts as batches of GEMMs through cuBLAS (`FERROLM_CUDA_NO_BATCH`: decode steps).
    pub batched_prompts: bool,
    /// Kernels launched to overlap their predecessors on compute capability 9.0 and later
    /// (`FERROLM_CUDA_NO_OVERLAP`).
    pub overlap: bool,
    /// Products on 8-bit activations as the CPU quantizes them (`FERROLM_CUDA_F32_ACT`: f32).
    pub quantized_activations: bool,
    /// Prompt attention on the tensor cores where the head width allows
    /// (`FERROLM_CUDA_ATTN_TILE`: the f32 tiles).
    pub tensor_core_attention: bool,
    /// Products that can copy their rows into shared memory before waiting do
    /// (`FERROLM_CUDA_NO_STAGE`).
    pub stage: bool,
    /// Q and K of one type with V of another in one launch where the kernels have the pair
    /// (`schedule::MIXED_QKV`; `FERROLM_CUDA_NO_MIXED_QKV`: a launch per type).
    pub mixed_qkv: bool,
    /// A block's output through its post-norm, the residual add and the next norm with each
    /// lane's values held in registers and the norms' weights loaded before the previous
    /// kernel ends (`post_norm_add_norm_held*`; `FERROLM_CUDA_NO_HELD_POST_NORM`: the
    /// values through shared memory).
    pub held_post_norm: bool,
    /// The decode attention of heads of 128 or 256 values by a block's warps, each over its
    /// own positions (`attn_split_warps`; `FERROLM_CUDA_NO_WARP_ATTENTION`: by 128-position
    /// tiles, `attn_split`).
    pub warp_attention: bool,
    /// The attention, the delta rule and the output gate quantize their outputs for the next
    /// product themselves where its format is Q8_0 or Q8_1, instead of a quantize_act launch
    /// (`FERROLM_CUDA_NO_PRODUCER_QUANT`: the launch).
    pub producer_quantize: bool,
    /// A token's expert outputs combined and the next norm taken by one block
    /// (`moe_combine_norm_held*`), an f32 shared-expert gate row dotted by the combination
    /// itself (`FERROLM_CUDA_NO_FUSED_COMBINE`: a launch each).
    pub fused_moe_combine: bool,
    /// The shared expert's gate/up and down products as one more grid row of the chosen
    /// experts' launches, where its rows match theirs in type and size
    /// (`FERROLM_CUDA_SHARED_IN_GRID=1`; off until measured on a GPU).
    pub shared_expert_in_grid: bool,
    /// The decode step's delta rule reads its state columns 16 values at a time before using
    /// them, so that their loads are in flight together (the same sums in the same order;
    /// `FERROLM_CUDA_DELTA_RUNS=1`, off until measured on a GPU).
    pub delta_runs: bool,
    /// The warps' decode attention rotates (and Q/K-norms) the token's query and key and stores
    /// its key and value itself, in place of a rope_store launch
    /// (`FERROLM_CUDA_NO_ROPE_IN_ATTENTION`: the rope_store launch).
    pub rope_in_attention: bool,
    /// The batched passes' kernels (several sequences' steps, prompts) launched to overlap
    /// their predecessors as the single stream's are (`FERROLM_CUDA_BATCH_OVERLAP=1`; off: slower
    /// decode steps, faster prompts, docs/PERFORMANCE.md).
    pub batch_overlap: bool,
    /// Q8_0 and Q6_K rows uploaded regrouped for 16-byte loads (`FERROLM_CUDA_NO_REPACK`).
    pub repack: bool,
    /// Eight warps for few, wide rows (`FERROLM_CUDA_MATVEC_128`: at most four).
    pub wide_matvec: bool,
    /// Most threads of a matrix-vector block, whole warps from 32 to 128
    /// (`FERROLM_CUDA_MATVEC_MAX_THREADS`).
    pub matvec_max_threads: usize,
    /// The largest residual product (rows x columns) whose blocks quantize their f32 input as
    /// they load it (`FERROLM_CUDA_QUANTIZE_ON_LOAD_MAX`; 0: none).
    pub quantize_on_load_max: usize,
    /// `#define` lines put ahead of the kernel source, `NAME=VALUE,...`
    /// (`FERROLM_CUDA_DEFINES`).
    pub defines: Option<String>,
    /// Where compiled kernels are cached (`None`: compiled at every start); by default
    /// `$FERROLM_HOME/kernels`, or `~/.cache/ferrolm/kernels`.
    pub kernel_cache: Option<PathBuf>,
    /// A prompt's expert groups padded to the largest, one strided-batched GEMM per matrix
    /// over all the experts, where that pads at most to twice the rows; a GEMM per used
    /// expert otherwise (`FERROLM_CUDA_NO_PADDED_GROUPS`).
    pub padded_expert_groups: bool,
    /// f16 copies of the quantized matrices kept for the batched passes' GEMMs where the device
    /// has room (and no `gpu_memory` budget), instead of dequantizing each matrix for every
    /// batch (`FERROLM_CUDA_NO_F16_WEIGHTS`).
    pub f16_weights: bool,
    /// f16 copies of the expert stacks kept for the prompts' GEMMs where the device has room
    /// (and no `gpu_memory` budget), instead of dequantizing each layer's stacks for every
    /// prompt batch (`FERROLM_CUDA_NO_F16_EXPERTS`).
    pub f16_experts: bool,
    /// Bytes of device memory the model may take (`--gpu-memory`): the expert stacks it
    /// leaves no room for stay in pinned host memory, read over the bus ([`crate::tiers`]);
    /// `None`: no budget, all on the device.
    pub gpu_memory: Option<u64>,
    /// Under a budget, of each token's chosen experts in a layer whose expert stacks stay in
    /// host memory, how many (the last) the CPU computes while the GPU reads the others over
    /// the bus ([`crate::cpu_tier`]; `FERROLM_CUDA_CPU_EXPERTS`, 0: none). At most one fewer
    /// than the experts a token uses. The default, 2, measured best on Qwen3-30B-A3B's shape
    /// under `--gpu-memory 6` (docs/PERFORMANCE.md).
    pub cpu_experts: usize,
    /// Instead, that count chosen at load by timing both sides on one layer: the GPU reading a
    /// token's experts over the bus, the CPU computing 1 .. k - 1 of them
    /// (`cpu_tier::choose_cpu_experts`; `--cpu-experts auto`, `FERROLM_CUDA_CPU_EXPERTS=auto`).
    pub cpu_experts_auto: bool,
    /// The CPU tier's threads (`FERROLM_CUDA_CPU_TIER_THREADS`; 0, the default: half the
    /// cores, as many more stay free for the threads that wait on the device: all of them
    /// measured twenty times slower).
    pub cpu_tier_threads: usize,
    /// In prompt batches, how many of each such layer's experts (the last ids) the CPU
    /// computes for every token that chose them while the GPU multiplies the others' groups
    /// ([`crate::cpu_prompt`]; `FERROLM_CUDA_PROMPT_CPU_EXPERTS`, 0: none, `auto`): `None`,
    /// the default, starts at three eighths of the experts and moves after each layer
    /// towards both sides finishing together (`PromptCpuShare::adapt`). Its threads: all the cores but two, or
    /// `cpu_tier_threads` if more.
    pub prompt_cpu_experts: Option<usize>,
    /// Under a budget, every expert stack in host memory and what the budget leaves as
    /// device slots for each layer's most chosen experts, re-chosen as the model runs
    /// ([`crate::slots`]; `FERROLM_CUDA_EXPERT_SLOTS=1`; off, the default: whole stacks on
    /// the device while they fit, until measured).
    pub expert_slots: bool,
    /// Decode steps between the slot cache's choices (`FERROLM_CUDA_SLOT_INTERVAL`).
    pub slot_interval: usize,
    /// Batched decode steps of at most this many rows multiply Q4_K and Q6_K matrices on the
    /// int8 tensor cores against 8-bit activations (`mmq_*`, reading the quantized blocks)
    /// instead of f16 GEMMs (`FERROLM_CUDA_MMQ_MAX_ROWS`; 0, the default: never). Measured
    /// faster on an 8B at 2 to 8 rows only, slower on a 1B and from 16 rows
    /// (docs/PERFORMANCE.md).
    pub mmq_max_rows: usize,
    /// The f16 GEMMs of at most this many input rows (up to 16) run ferrolm's
    /// `skinny_gemm_8`/`_16` instead of cuBLAS's (`FERROLM_CUDA_SKINNY_GEMM_MAX_ROWS`; 0:
    /// cuBLAS always). The default, 8, is where it was measured faster (docs/PERFORMANCE.md).
    pub skinny_gemm_max_rows: usize,
    /// Batched decode steps of at most this many rows (up to 16) multiply Q4_K matrices by
    /// `dq4k_gemm_*`, which reads their blocks and dequantizes them in registers, instead of
    /// GEMMs over f16 copies (`FERROLM_CUDA_DQ_GEMM_MAX_ROWS`; 0: never; docs/PERFORMANCE.md).
    pub dq_gemm_max_rows: usize,
    /// Q, K and V, and gate and up, where two or three of them go through `dq4k_gemm_*`, as
    /// one launch (`dq4k_gemm3_*`; `FERROLM_CUDA_NO_DQ_SEGMENTS`: one by one). With
    /// [`CudaTuning::dq_glu`], 10% faster 16-row steps on an 8B (docs/PERFORMANCE.md).
    pub dq_segments: bool,
    /// Gate and up through `dq4k_gemm_*` as one launch that writes the activation's f16 rows
    /// (`dq4k_glu_*`: no f32 gate and up rows, no activation launch;
    /// `FERROLM_CUDA_NO_DQ_GLU`: apart).
    pub dq_glu: bool,
    /// An f32 router's product (at most 1024 experts, no bias) in the decode step's routing
    /// launch (`moe_route_f32`: each row in up to 8 runs of columns, a warp each, so that the
    /// whole matrix is read at once; the last block adds the runs and routes;
    /// `FERROLM_CUDA_ROUTER_IN_ROUTE=1`, off until measured: a warp a whole row measured
    /// within noise of apart on an H100, the runs are not yet measured).
    pub router_in_route: bool,
    /// Those products by `dq4k_pipe_*` (warps a block, super-blocks in flight: one of
    /// [`crate::prefill::DQ_PIPES`]), the pipelined layout, rather than `dq4k_gemm_*`
    /// (`FERROLM_CUDA_DQ_PIPE=4x3`; `None`, the default: slower than `dq4k_gemm_*` on an H100,
    /// docs/PERFORMANCE.md).
    pub dq_pipe: Option<(usize, usize)>,
    /// Those steps' Q6_K matrices (regrouped, Q6_KR) through `dq6k_pipe_*` too, instead of f16
    /// GEMMs over their copies (`FERROLM_CUDA_DQ6_PIPE=1`; off: no faster on an H100).
    pub dq6_pipe: bool,
    /// A model holding several sequences maps its KV caches' memory in pages as each
    /// sequence grows, from a pool of `kv_memory` bytes ([`crate::kv_pages`];
    /// `FERROLM_CUDA_NO_PAGED_KV`: every slot's whole context allocated up front).
    pub paged_kv: bool,
    /// Bytes of the paged KV caches' pool (`--kv-memory`); `None`: every slot's whole context
    /// where free memory allows it, else what is free (at least one whole context).
    pub kv_memory: Option<u64>,
}

impl Default for CudaTuning {
    fn default() -> Self {
        CudaTuning {
            graphs: true,
            batched_prompts: true,
            overlap: true,
            quantized_activations: true,
            tensor_core_attention: true,
            stage: true,
            mixed_qkv: true,
            held_post_norm: true,
            warp_attention: true,
            producer_quantize: true,
            fused_moe_combine: true,
            shared_expert_in_grid: false,
            delta_runs: false,
            rope_in_attention: true,
            batch_overlap: false,
            repack: true,
            wide_matvec: true,
            matvec_max_threads: 128,
            quantize_on_load_max: 1 << 20,
            defines: None,
            kernel_cache: Some(crate::kernels::cache_dir()),
            padded_expert_groups: true,
            f16_weights: true,
            f16_experts: true,
            gpu_memory: None,
            cpu_experts: 2,
            cpu_experts_auto: false,
            cpu_tier_threads: 0,
            prompt_cpu_experts: None,
            expert_slots: false,
            slot_interval: 64,
            mmq_max_rows: 0,
            skinny_gemm_max_rows: 8,
            dq_gemm_max_rows: 16,
            dq_segments: true,
            dq_glu: true,
            router_in_route: false,
            dq_pipe: None,
            dq6_pipe: false,
            paged_kv: true,
            kv_memory: None,
        }
    }
}

impl CudaTuning {
    /// The defaults, changed by the `FERROLM_CUDA_*` variables set (for binaries; see the
    /// field docs).
    pub fn from_env() -> CudaTuning {
        let unset = |name: &str| std::env::var_os(name).is_none();
        let number = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
        let d = CudaTuning::default();
        CudaTuning {
            graphs: unset("FERROLM_CUDA_NO_GRAPH"),
            batched_prompts: unset("FERROLM_CUDA_NO_BATCH"),
            overlap: unset("FERROLM_CUDA_NO_OVERLAP"),
            quantized_activations: unset("FERROLM_CUDA_F32_ACT"),
            tensor_core_attention: unset("FERROLM_CUDA_ATTN_TILE"),
            stage: unset("FERROLM_CUDA_NO_STAGE"),
            mixed_qkv: unset("FERROLM_CUDA_NO_MIXED_QKV"),
            held_post_norm: unset("FERROLM_CUDA_NO_HELD_POST_NORM"),
            warp_attention: unset("FERROLM_CUDA_NO_WARP_ATTENTION"),
            producer_quantize: unset("FERROLM_CUDA_NO_PRODUCER_QUANT"),
            fused_moe_combine: unset("FERROLM_CUDA_NO_FUSED_COMBINE"),
            shared_expert_in_grid: !unset("FERROLM_CUDA_SHARED_IN_GRID"),
            delta_runs: !unset("FERROLM_CUDA_DELTA_RUNS"),
            rope_in_attention: unset("FERROLM_CUDA_NO_ROPE_IN_ATTENTION"),
            batch_overlap: !unset("FERROLM_CUDA_BATCH_OVERLAP"),
            repack: unset("FERROLM_CUDA_NO_REPACK"),
            wide_matvec: unset("FERROLM_CUDA_MATVEC_128"),
            matvec_max_threads: number("FERROLM_CUDA_MATVEC_MAX_THREADS")
                .unwrap_or(d.matvec_max_threads),
            quantize_on_load_max: number("FERROLM_CUDA_QUANTIZE_ON_LOAD_MAX")
                .unwrap_or(d.quantize_on_load_max),
            defines: std::env::var("FERROLM_CUDA_DEFINES").ok(),
            kernel_cache: d.kernel_cache.clone(),
            padded_expert_groups: unset("FERROLM_CUDA_NO_PADDED_GROUPS"),
            f16_weights: unset("FERROLM_CUDA_NO_F16_WEIGHTS"),
            f16_experts: unset("FERROLM_CUDA_NO_F16_EXPERTS"),
            gpu_memory: None,
            cpu_experts: number("FERROLM_CUDA_CPU_EXPERTS").unwrap_or(d.cpu_experts),
            cpu_experts_auto: std::env::var("FERROLM_CUDA_CPU_EXPERTS").is_ok_and(|v| v == "auto"),
            cpu_tier_threads: number("FERROLM_CUDA_CPU_TIER_THREADS").unwrap_or(d.cpu_tier_threads),
            prompt_cpu_experts: match std::env::var("FERROLM_CUDA_PROMPT_CPU_EXPERTS") {
                Ok(v) if v != "auto" => v.parse().ok().or(d.prompt_cpu_experts),
                _ => d.prompt_cpu_experts,
            },
            expert_slots: !unset("FERROLM_CUDA_EXPERT_SLOTS"),
            slot_interval: number("FERROLM_CUDA_SLOT_INTERVAL").unwrap_or(d.slot_interval),
            mmq_max_rows: number("FERROLM_CUDA_MMQ_MAX_ROWS").unwrap_or(d.mmq_max_rows),
            skinny_gemm_max_rows: number("FERROLM_CUDA_SKINNY_GEMM_MAX_ROWS")
                .unwrap_or(d.skinny_gemm_max_rows),
            dq_gemm_max_rows: number("FERROLM_CUDA_DQ_GEMM_MAX_ROWS").unwrap_or(d.dq_gemm_max_rows),
            dq_segments: unset("FERROLM_CUDA_NO_DQ_SEGMENTS"),
            dq_glu: unset("FERROLM_CUDA_NO_DQ_GLU"),
            router_in_route: !unset("FERROLM_CUDA_ROUTER_IN_ROUTE"),
            dq6_pipe: std::env::var_os("FERROLM_CUDA_DQ6_PIPE").is_some(),
            dq_pipe: match std::env::var("FERROLM_CUDA_DQ_PIPE").ok().as_deref() {
                None => d.dq_pipe,
                Some(v) => v
                    .split_once('x')
                    .and_then(|(w, s)| Some((w.parse().ok()?, s.parse().ok()?)))
                    .filter(|l| crate::prefill::DQ_PIPES.contains(l)),
            },
            paged_kv: unset("FERROLM_CUDA_NO_PAGED_KV"),
            kv_memory: None,
        }
    }

    /// Threads of a matrix-vector block over `rows` rows of `n_chunks` chunks of 32: a thread
    /// a chunk, from one warp to four; eight warps for few (at most 2048), wide (256 chunks or
    /// more) rows, a down product's (measured: docs/PERFORMANCE.md, issue 6).
    pub fn matvec_threads(&self, n_chunks: usize, rows: usize) -> u32 {
        if n_chunks >= 256 && rows <= 2048 && self.wide_matvec {
            return 256;
        }
        // Whole warps: the kernels' reductions count on them.
        let most = self.matvec_max_threads.clamp(32, 128) / 32 * 32;
        (n_chunks.next_multiple_of(32)).clamp(32, most) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matvec_blocks_are_whole_warps_within_the_bounds() {
        let t = CudaTuning::default();
        assert_eq!(t.matvec_threads(448, 4096), 128);
        assert_eq!(t.matvec_threads(448, 2048), 256);
        assert_eq!(t.matvec_threads(3, 100), 32);
        let narrow = CudaTuning {
            wide_matvec: false,
            matvec_max_threads: 100,
            ..CudaTuning::default()
        };
        assert_eq!(narrow.matvec_threads(448, 2048), 96);
    }
}
