//! The engine: the backend interface every device implements, sampling, and generation over a
//! backend's slot and a tokenizer.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod backend;
pub mod constraint;
mod generate;
mod sampler;
pub mod sequence;

pub use backend::{
    Backend, BackendError, CpuBackend, ExpertTierStats, SlotInput, SlotOutput, TopOutput,
};
pub use generate::{
    eval_one, generate, generate_observed, FinishReason, GenerateError, GenerateParams, Generation,
};
pub use sampler::{argmax, top_k, Sampler, SamplerParams};
