//! GGUF files: a validated, zero-copy reader and a writer.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod tensor_type;

pub use tensor_type::TensorType;
