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
    /// A streamed-expert cache smaller than the experts one token runs in one layer.
    #[error(
        "the expert cache of {given} bytes cannot hold one token's experts: {experts_per_token} \
         experts of {expert_bytes} bytes need {needed} bytes"
    )]
    ExpertCacheTooSmall {
        /// Bytes one token's experts need.
        needed: usize,
        /// The cache's size.
        given: usize,
        /// Experts one token runs.
        experts_per_token: usize,
        /// Bytes of one expert (its gate, up and down matrices).
        expert_bytes: usize,
    },
    /// Reading a streamed expert's weights from the file failed.
    #[error("reading expert {expert} of layer {layer} from the file: {source}")]
    ExpertRead {
        /// The layer.
        layer: usize,
        /// The expert.
        expert: usize,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A batched pass failed (each of its sequences gets this, and stays where it was).
    #[error("the batch failed: {0}")]
    BatchFailed(String),
    /// A metadata value that makes no sense (zero heads, head count not dividing, ...).
    #[error("invalid hyperparameter: {0}")]
    Invalid(String),
    /// Experts asked of [`crate::HostExperts`] that it cannot compute.
    #[error("experts on the CPU for another executor: {0}")]
    HostExperts(String),
}

/// Results of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
