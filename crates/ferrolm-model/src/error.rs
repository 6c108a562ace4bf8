//! What can go wrong loading or running a model.

use ferrolm_gguf::{GgufError, TensorType};

/// An error loading or running a model; each names what is wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The file could not be read or its metadata is not what the architecture needs.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// An architecture we do not know.
    #[error("unknown architecture {0:?} (supported: {1})")]
    UnknownArchitecture(String, String),
    /// A metadata value we cannot serve.
    #[error("unsupported {what}: {value}")]
    Unsupported {
        /// What is unsupported.
        what: &'static str,
        /// The value found.
        value: String,
    },
    /// A tensor the plan needs is absent.
    #[error("tensor {0:?} is missing (needed by the layer plan)")]
    MissingTensor(String),
    /// A tensor of another shape than the plan needs.
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    WrongShape {
        /// The tensor.
        name: String,
        /// The dimensions the plan needs.
        expected: Vec<u64>,
        /// The dimensions in the file.
        found: Vec<u64>,
    },
    /// A tensor type the CPU kernels do not compute with.
    #[error("tensor {name:?} has type {ty}, which ferrolm cannot compute with yet")]
    UnsupportedTensorType {
        /// The tensor.
        name: String,
        /// Its type.
        ty: TensorType,
    },
    /// More tokens than the context holds.
    #[error("context full: {needed} tokens needed, the context holds {n_ctx}")]
    ContextFull {
        /// Positions needed.
        needed: usize,
        /// The context size.
        n_ctx: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        n_vocab: usize,
    },
    /// A metadata value that makes no sense (zero heads, head count not dividing, ...).
    #[error("invalid hyperparameter: {0}")]
    Invalid(String),
}

/// Results of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
