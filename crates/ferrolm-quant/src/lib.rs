//! Quantized block formats (work in progress).
#![deny(missing_docs)]

pub use ferrolm_gguf::TensorType;
