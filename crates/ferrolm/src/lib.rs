//! ferrolm as a library: open a GGUF model, put it on a device, and generate.
//!
//! A [`LoadedModel`] is the file's weights and tokenizer; [`LoadedModel::backend`] makes it
//! ready on a device (the CPU or a CUDA GPU) as a [`Backend`] with its own sequences ("slots");
//! [`LoadedModel::stream`] generates in one slot as an iterator of text pieces, and
//! [`generate`] does the same with a callback, choosing tokens on the device where it can.
//!
//! ```no_run
//! use ferrolm::{BackendOptions, GenerateParams, LoadedModel, SamplerParams};
//!
//! let model = LoadedModel::open("model.gguf", &Default::default())?;
//! let mut backend = model.backend(&BackendOptions::default())?;
//! let params = GenerateParams {
//!     max_tokens: 64,
//!     sampler: SamplerParams::greedy(),
//!     stop_at_eog: true,
//! };
//! for piece in model.stream(backend.as_mut(), "The capital of France is", &params)? {
//!     print!("{}", piece?);
//! }
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! The `ferrolm` binary is this library's first user: its commands parse arguments and call
//! what is here. docs/ARCHITECTURE.md in the repository shows how the pieces fit.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod open;
mod stream;

pub use ferrolm_cuda::{CudaTuning, Device};
pub use ferrolm_engine::{
    eval_one, generate, Backend, BackendError, CpuBackend, FinishReason, GenerateError,
    GenerateParams, Generation, SamplerParams, SlotInput, SlotOutput,
};
pub use ferrolm_model::{ExpertMode, LoadOptions, Logits, Model};
pub use ferrolm_quant::KernelOptions;
pub use ferrolm_tokenizer::Tokenizer;
pub use open::{context_size, open_backend, BackendOptions, LoadedModel};
pub use stream::TokenStream;
