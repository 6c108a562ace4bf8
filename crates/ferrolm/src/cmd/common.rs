//! What several commands share: loading a model with its tokenizer, sampling flags.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm::{Backend, BackendOptions, CudaTuning, Device};
use ferrolm_engine::SamplerParams;
use ferrolm_gguf::GgufFile;
use ferrolm_model::{ExpertMode, LoadOptions, Model};
use ferrolm_quant::KernelOptions;
use ferrolm_tokenizer::Tokenizer;

use crate::models;

/// `-m` and `-t`.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A GGUF file (of a split model: its first shard), a known model's name, or
    /// hf:ORG/REPO[:QUANT|/FILE.gguf] (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(short, long)]
    pub model: Option<String>,
    /// Threads (0: every core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// Where to run: cpu, cuda or cuda:N (default: CUDA device 0 when one is present, the CPU
    /// otherwise). A model the CUDA path does not serve runs on the CPU, saying why.
    #[arg(long, value_name = "cpu|cuda|cuda:N")]
    pub device: Option<String>,
    /// Stream a mixture-of-experts model's experts from the file through a cache of this many
    /// MB instead of keeping them mapped (0: keep them mapped). Without it, experts are
    /// streamed when they exceed 75% of physical memory, through a cache of half of it less
    /// the dense weights.
    #[arg(long, value_name = "MB")]
    pub expert_cache: Option<u64>,
    /// With CUDA, only the first N layers on the GPU, the rest and the output head on the CPU
    /// (a model larger than the GPU's memory); default: every layer. 0: the CPU alone.
    #[arg(long, value_name = "N")]
    pub gpu_layers: Option<usize>,
    /// With CUDA, the most device memory the model may take, in GB (1e9 bytes): the expert
    /// tensors it leaves no room for stay in pinned host memory, read by the GPU over the bus;
    /// too small for everything but the experts is an error saying how much is needed.
    #[arg(long, value_name = "GB")]
    pub gpu_memory: Option<f64>,
    /// With CUDA and `--gpu-memory`: of each token's chosen experts in a layer left in host
    /// memory, how many the CPU computes (on half the cores) while the GPU reads the others
    /// over the bus; 0: the GPU reads them all; auto: the count that timing both sides at load
    /// gives. Default 2 (at most one fewer than a token's experts).
    #[arg(long, value_name = "N|auto")]
    pub cpu_experts: Option<String>,
    /// With CUDA and `--gpu-memory`: keep every expert stack in host memory and use the
    /// budget's rest as device slots for each layer's most chosen experts, re-chosen as the
    /// model runs, instead of whole layers' stacks on the device while they fit.
    #[arg(long)]
    pub expert_slots: bool,
    /// With CUDA and several sequences (`serve --parallel`, `bench --batch`), the most device
    /// memory their KV caches may take, in GB: pages are mapped as sequences grow, and a
    /// request waits while others hold the rest. Default: every sequence's whole context
    /// where free memory allows it.
    #[arg(long, value_name = "GB")]
    pub kv_memory: Option<f64>,
    /// On the CPU, sum the products as llama.cpp does with `--no-repack` (its weights kept as
    /// in the file) instead of as its default, which repacks Q4_K matrices on x86-64 CPUs
    /// with AVX2 and sums them in another order.
    #[arg(long)]
    pub no_repack: bool,
    /// On the CPU, sum batches of 8 or more tokens as llama.cpp does with
    /// `GGML_CPU_TILED_MM=0` (no tiled matmul for the K-quants and i-quants).
    #[arg(long)]
    pub no_tiled: bool,
}

/// `--cpu-experts`: a count, or chosen by timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CpuExperts {
    /// This many.
    Count(usize),
    /// As timing both sides at load chooses.
    Auto,
}

fn parse_cpu_experts(v: &str) -> Result<CpuExperts> {
    if v == "auto" {
        return Ok(CpuExperts::Auto);
    }
    match v.parse() {
        Ok(n) => Ok(CpuExperts::Count(n)),
        Err(_) => bail!("--cpu-experts {v}: a number of experts, or auto"),
    }
}

/// A flag's GB in bytes, refused when it is not a positive number.
fn gigabytes(flag: &str, gb: Option<f64>) -> Result<Option<u64>> {
    match gb {
        None => Ok(None),
        Some(gb) if gb.is_finite() && gb > 0.0 => Ok(Some((gb * 1e9) as u64)),
        Some(gb) => bail!("{flag} {gb}: a positive number of GB"),
    }
}

impl ModelArgs {
    /// `--gpu-memory` in bytes, refused when it is not a positive number of GB.
    pub fn gpu_memory_bytes(&self) -> Result<Option<u64>> {
        gigabytes("--gpu-memory", self.gpu_memory)
    }

    /// The CUDA tuning the environment and these flags give.
    pub fn cuda_tuning(&self) -> Result<CudaTuning> {
        if self.gpu_memory.is_none() && (self.cpu_experts.is_some() || self.expert_slots) {
            bail!("--cpu-experts and --expert-slots place the experts under a --gpu-memory budget: give one");
        }
        let env = CudaTuning::from_env();
        let cpu_experts = self
            .cpu_experts
            .as_deref()
            .map(parse_cpu_experts)
            .transpose()?;
        Ok(CudaTuning {
            gpu_memory: self.gpu_memory_bytes()?,
            kv_memory: gigabytes("--kv-memory", self.kv_memory)?,
            cpu_experts: match cpu_experts {
                Some(CpuExperts::Count(n)) => n,
                _ => env.cpu_experts,
            },
            cpu_experts_auto: match cpu_experts {
                Some(c) => c == CpuExperts::Auto,
                None => env.cpu_experts_auto,
            },
            expert_slots: self.expert_slots || env.expert_slots,
            ..env
        })
    }

    /// How to load the model these flags name; `FERROLM_FORCE_SCALAR` (set to anything) picks
    /// the scalar reference kernels.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            threads: self.threads,
            kernels: KernelOptions {
                scalar: std::env::var_os("FERROLM_FORCE_SCALAR").is_some(),
                repack: !self.no_repack,
                tiled: !self.no_tiled,
            },
            experts: match self.expert_cache {
                None => ExpertMode::Auto,
                Some(0) => ExpertMode::Resident,
                Some(mb) => ExpertMode::Streamed {
                    cache_bytes: usize::try_from(mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
                },
            },
        }
    }

    /// Loads the model at `path` as these flags say, telling on stderr when its experts are
    /// streamed.
    pub fn load_model(&self, path: &std::path::Path) -> Result<Model> {
        let file = Arc::new(GgufFile::open(path)?);
        self.model_from(file, path)
    }

    fn model_from(&self, file: Arc<GgufFile>, path: &std::path::Path) -> Result<Model> {
        let mut model = Model::from_file_with(file, &self.load_options())
            .with_context(|| format!("loading {}", path.display()))?;
        // FERROLM_DUMP=dir: every forward pass's intermediate tensors, for
        // scripts/dump_compare.py.
        model.set_dump_dir(std::env::var_os("FERROLM_DUMP").map(Into::into));
        let streamed = model.expert_cache_stats();
        if streamed.is_none() && self.expert_cache.is_some_and(|mb| mb > 0) {
            eprintln!("ferrolm: --expert-cache: the model has no experts to stream; ignored");
        }
        if let Some(st) = streamed {
            let mb = |b: u64| b as f64 / (1u64 << 20) as f64;
            eprintln!(
                "ferrolm: streaming experts ({:.0} MB) from the file through a {:.0} MB cache \
                 ({} experts of {:.2} MB){}",
                mb(st.expert_bytes),
                mb(st.cache_bytes as u64),
                st.slots,
                mb(st.slot_bytes as u64),
                if st.automatic {
                    format!(
                        ": they exceed {:.0}% of physical memory (--expert-cache MB to choose)",
                        ferrolm_model::STREAM_ABOVE_SHARE * 100.0
                    )
                } else {
                    String::new()
                }
            );
        }
        Ok(model)
    }
}

/// `model` ready where these flags say, with `slots` sequences of `n_ctx` positions
/// ([`ferrolm::open_backend`]: an explicit `--device cuda` that cannot be used is an error, a
/// model the CUDA path declines runs on the CPU, saying why).
pub fn open_backend<'m>(
    args: &ModelArgs,
    model: &'m Model,
    n_ctx: usize,
    slots: usize,
) -> Result<Box<dyn Backend + 'm>> {
    let device = match &args.device {
        Some(d) => Some(d.parse::<Device>().map_err(anyhow::Error::msg)?),
        None => None,
    };
    ferrolm::open_backend(
        model,
        &BackendOptions {
            device,
            n_ctx,
            slots,
            gpu_layers: args.gpu_layers,
            verbose: true,
            cuda: args.cuda_tuning()?,
        },
    )
}

/// Sampling flags.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Presence penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Seed of the draws (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler these flags describe.
    pub fn params(&self) -> SamplerParams {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        SamplerParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: 64,
            seed,
        }
    }
}

/// The model `-m` names and its tokenizer, loaded as the flags say.
pub fn load_any_device(args: &ModelArgs) -> Result<(Model, Tokenizer)> {
    let path = models::resolve(args.model.as_deref())?;
    let file = Arc::new(GgufFile::open(&path)?);
    let tokenizer = Tokenizer::from_metadata(file.metadata())
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let model = args.model_from(file, &path)?;
    Ok((model, tokenizer))
}

/// The context size: `--ctx-size` if given (0: default), capped by the model's trained length.
pub fn context_size(model: &Model, requested: usize) -> usize {
    ferrolm::context_size(model, requested)
}
