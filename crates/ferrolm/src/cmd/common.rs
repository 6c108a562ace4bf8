//! What several commands share: loading a model with its tokenizer, sampling flags.

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use ferrolm_cuda::{CudaError, CudaModel, Device};
use ferrolm_engine::SamplerParams;
use ferrolm_gguf::GgufFile;
use ferrolm_model::{ExpertMode, LoadOptions, Model};
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
}

impl ModelArgs {
    /// How to load the model these flags name.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            threads: self.threads,
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
        let model = Model::from_file_with(file, &self.load_options())
            .with_context(|| format!("loading {}", path.display()))?;
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

    /// The device asked for, or the default one; `true` when asked for explicitly.
    pub fn device(&self) -> Result<(Device, bool)> {
        match &self.device {
            Some(d) => Ok((d.parse::<Device>().map_err(anyhow::Error::msg)?, true)),
            None => Ok((ferrolm_cuda::default_device(), false)),
        }
    }
}

/// The model on the GPU the flags ask for, or `None` for the CPU: an explicit `--device cuda`
/// without CUDA is an error; a model the CUDA path declines, or any failure when CUDA was only
/// the default, says so on stderr and leaves the CPU to run it.
pub fn cuda_model(args: &ModelArgs, model: &Model, n_ctx: usize) -> Result<Option<CudaModel>> {
    let (device, explicit) = args.device()?;
    let Device::Cuda(ordinal) = device else {
        return Ok(None);
    };
    if model.expert_cache_stats().is_some() {
        // The CUDA path uploads every weight from the mapping, experts included.
        let why = "streamed experts run on the CPU only";
        if explicit {
            anyhow::bail!("--device {device}: {why}; drop --expert-cache or --device");
        }
        eprintln!("ferrolm: {why}; running on the CPU");
        return Ok(None);
    }
    let n_layer = model.plan().layers.len();
    let gpu_layers = args.gpu_layers.unwrap_or(n_layer);
    if gpu_layers == 0 {
        eprintln!("ferrolm: --gpu-layers 0: running on the CPU");
        return Ok(None);
    }
    match CudaModel::with_layers(model.plan(), model.file(), ordinal, n_ctx, gpu_layers) {
        Ok(m) => {
            eprintln!(
                "ferrolm: running {} on {} ({device}), {}",
                if m.is_whole() {
                    "the model".to_string()
                } else {
                    format!(
                        "layers 0..{} of {n_layer} ({} and the output head on the CPU)",
                        m.gpu_layers(),
                        n_layer - m.gpu_layers()
                    )
                },
                m.device_name(),
                if m.uses_graph() {
                    "one CUDA graph launch per token"
                } else {
                    "kernel by kernel (FERROLM_CUDA_NO_GRAPH)"
                }
            );
            Ok(Some(m))
        }
        Err(e @ CudaError::Declined(_)) => {
            eprintln!("ferrolm: {e}; running on the CPU");
            Ok(None)
        }
        Err(e) if explicit => Err(anyhow::anyhow!("--device {device}: {e}")),
        Err(e) => {
            eprintln!("ferrolm: {e}; running on the CPU");
            Ok(None)
        }
    }
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

/// [`load`] for a command that takes the model to the GPU itself ([`cuda_model`]).
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
    let trained = model.plan().n_ctx_train;
    if requested == 0 {
        trained.min(4096)
    } else {
        requested.min(trained)
    }
}
