//! Opening a model and making it ready on a device.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ferrolm_cuda::{CudaError, CudaOptions, CudaTuning, Device};
use ferrolm_engine::{Backend, CpuBackend, GenerateParams};
use ferrolm_gguf::GgufFile;
use ferrolm_model::{LoadOptions, Model};
use ferrolm_tokenizer::Tokenizer;

use crate::stream::TokenStream;

/// A GGUF file's model and tokenizer, loaded.
pub struct LoadedModel {
    /// The model (its plan and weights, mapped from the file).
    pub model: Model,
    /// The file's tokenizer.
    pub tokenizer: Tokenizer,
    /// Where it came from.
    pub path: PathBuf,
}

impl LoadedModel {
    /// Loads the model and tokenizer of the GGUF file at `path`.
    pub fn open(path: impl AsRef<Path>, options: &LoadOptions) -> Result<LoadedModel> {
        let path = path.as_ref();
        let file = Arc::new(GgufFile::open(path)?);
        let tokenizer = Tokenizer::from_metadata(file.metadata())
            .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
        let model = Model::from_file_with(file, options)
            .with_context(|| format!("loading {}", path.display()))?;
        Ok(LoadedModel {
            model,
            tokenizer,
            path: path.to_path_buf(),
        })
    }

    /// The model ready on the device `options` name ([`open_backend`]).
    pub fn backend(&self, options: &BackendOptions) -> Result<Box<dyn Backend + '_>> {
        open_backend(&self.model, options)
    }

    /// Generates after `prompt` (encoded as a prompt: BOS and special tokens as the file says)
    /// in slot 0 of `backend`, which it empties first: an iterator of text pieces.
    pub fn stream<'a>(
        &'a self,
        backend: &'a mut dyn Backend,
        prompt: &str,
        params: &GenerateParams,
    ) -> Result<TokenStream<'a>> {
        let ids = self.tokenizer.encode_prompt(prompt);
        TokenStream::new(backend, 0, &self.tokenizer, ids, params)
    }
}

/// Where and how [`open_backend`] makes a model ready.
#[derive(Clone, Debug)]
pub struct BackendOptions {
    /// The device; `None`: CUDA device 0 when one is present, the CPU otherwise, falling back
    /// to the CPU (saying why on stderr) when CUDA fails or declines the model.
    pub device: Option<Device>,
    /// Positions of each slot's context (0: the model's trained length, at most 4096).
    pub n_ctx: usize,
    /// Sequences held at once; a backend may hold fewer ([`Backend::n_slots`]).
    pub slots: usize,
    /// With CUDA, only the first N layers on the GPU (0: the CPU alone; `None`: all).
    pub gpu_layers: Option<usize>,
    /// Say on stderr where the model runs.
    pub verbose: bool,
    /// The CUDA backend's switches and sizes.
    pub cuda: CudaTuning,
}

impl Default for BackendOptions {
    fn default() -> Self {
        BackendOptions {
            device: None,
            n_ctx: 0,
            slots: 1,
            gpu_layers: None,
            verbose: false,
            cuda: CudaTuning::default(),
        }
    }
}

/// `model` ready on the device `options` ask for. An explicit CUDA device that cannot be used
/// is an error; a model the CUDA path declines runs on the CPU, saying which field made it
/// decline; without an explicit device, any CUDA failure falls back to the CPU.
pub fn open_backend<'m>(
    model: &'m Model,
    options: &BackendOptions,
) -> Result<Box<dyn Backend + 'm>> {
    let n_ctx = context_size(model, options.n_ctx);
    let slots = options.slots.max(1);
    let (device, explicit) = match options.device {
        Some(d) => (d, true),
        None => (ferrolm_cuda::default_device(), false),
    };
    let cpu = |why: Option<String>| -> Box<dyn Backend + 'm> {
        if let Some(why) = why {
            eprintln!("ferrolm: {why}; running on the CPU");
        }
        Box::new(CpuBackend::new(model, slots, n_ctx))
    };
    let Device::Cuda(ordinal) = device else {
        return Ok(cpu(None));
    };
    if options.gpu_layers == Some(0) {
        return Ok(cpu(Some("--gpu-layers 0".into())));
    }
    let cuda = CudaOptions {
        ordinal,
        n_ctx,
        gpu_layers: options.gpu_layers,
        slots,
        tuning: options.cuda.clone(),
    };
    match ferrolm_cuda::open(model, &cuda) {
        Ok(backend) => {
            if options.verbose {
                eprintln!("ferrolm: running on {} ({device})", backend.describe());
            }
            if slots > backend.n_slots() {
                eprintln!(
                    "ferrolm: {} holds {} sequence(s) at a time; the others wait",
                    backend.describe(),
                    backend.n_slots()
                );
            }
            Ok(backend)
        }
        Err(e @ CudaError::Declined(_)) => Ok(cpu(Some(e.to_string()))),
        Err(e) if explicit => bail!("--device {device}: {e}"),
        Err(e) => Ok(cpu(Some(e.to_string()))),
    }
}

/// The context size: `requested` if not 0, capped by the model's trained length; 0: the
/// trained length, at most 4096.
pub fn context_size(model: &Model, requested: usize) -> usize {
    let trained = model.plan().n_ctx_train;
    if requested == 0 {
        trained.min(4096)
    } else {
        requested.min(trained)
    }
}
