//! The engine: sampling and generation over a model session and its tokenizer.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod constraint;
mod generate;
mod sampler;
pub mod sequence;

pub use generate::{generate, FinishReason, Forward, GenerateError, GenerateParams, Generation};
pub use sampler::{argmax, Sampler, SamplerParams};
