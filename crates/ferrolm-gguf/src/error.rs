//! Everything that can be wrong with a GGUF file, each error naming what and where.

use std::path::PathBuf;

use crate::TensorType;

/// An error reading, validating or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: the magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The first bytes of the file.
        found: Vec<u8>,
    },
    /// A big-endian GGUF file (we read only little-endian ones).
    #[error("big-endian GGUF files are not supported")]
    BigEndian,
    /// A GGUF version other than 2 or 3.
    #[error("unsupported GGUF version {0} (supported: 2 and 3)")]
    UnsupportedVersion(u32),
    /// The file ends before something it declares.
    #[error("file truncated: {what} at byte {offset} needs {need} bytes, only {have} remain")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// Bytes it needs.
        need: u64,
        /// Bytes left in the file.
        have: u64,
    },
    /// A count (of tensors, keys, array elements) that the file cannot possibly hold.
    #[error("{what}: count {count} cannot fit in the {remaining} bytes left in the file")]
    CountTooLarge {
        /// What is counted.
        what: String,
        /// The count found.
        count: u64,
        /// Bytes left in the file.
        remaining: u64,
    },
    /// A string that is not UTF-8.
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which string.
        what: String,
        /// Where it starts.
        offset: u64,
    },
    /// A metadata value type id we do not know.
    #[error("metadata key {key:?}: unknown value type {id}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type id found.
        id: u32,
    },
    /// Arrays nested deeper than we accept.
    #[error("metadata key {key:?}: arrays nested more than {max} deep")]
    NestingTooDeep {
        /// The key.
        key: String,
        /// The deepest nesting accepted.
        max: usize,
    },
    /// The same metadata key twice.
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    /// The same tensor name twice.
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    /// `general.alignment` that is zero, not a power of two, or of the wrong type.
    #[error("general.alignment must be a non-zero power of two u32, found {0}")]
    BadAlignment(String),
    /// A tensor with more dimensions than GGML allows.
    #[error("tensor {name:?} has {n_dims} dimensions, at most {max} are allowed")]
    TooManyDims {
        /// The tensor.
        name: String,
        /// Its dimension count.
        n_dims: u32,
        /// The limit.
        max: u32,
    },
    /// Dimensions whose product (or byte size) overflows.
    #[error("tensor {name:?}: dimensions {dims:?} overflow when multiplied")]
    DimOverflow {
        /// The tensor.
        name: String,
        /// Its dimensions.
        dims: Vec<u64>,
    },
    /// A tensor type id we do not know.
    #[error("tensor {name:?}: unknown tensor type id {id}")]
    UnknownTensorType {
        /// The tensor.
        name: String,
        /// The type id found.
        id: u32,
    },
    /// A row length that is not a whole number of blocks.
    #[error(
        "tensor {name:?}: first dimension {ne0} is not a multiple of {ty}'s block size {block}"
    )]
    NotWholeBlocks {
        /// The tensor.
        name: String,
        /// Its type.
        ty: TensorType,
        /// Its first dimension.
        ne0: u64,
        /// The block size of the type.
        block: usize,
    },
    /// A tensor offset not on the file's alignment.
    #[error(
        "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedOffset {
        /// The tensor.
        name: String,
        /// Its offset within the data section.
        offset: u64,
        /// The alignment.
        alignment: u64,
    },
    /// Tensor data that reaches past the end of the file.
    #[error("tensor {name:?}: data at offset {offset} of {size} bytes lies outside the {data_len}-byte data section")]
    DataOutOfBounds {
        /// The tensor.
        name: String,
        /// Its offset within the data section.
        offset: u64,
        /// Its size in bytes.
        size: u64,
        /// Bytes in the data section.
        data_len: u64,
    },
    /// Two tensors whose data overlap.
    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    Overlap {
        /// The tensor that starts first.
        first: String,
        /// The tensor that starts inside it.
        second: String,
    },
    /// A metadata key that is required and absent.
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),
    /// A metadata value of another type than asked for.
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What the caller wanted.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },
    /// A tensor that is required and absent.
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
    /// Tensor data handed to the writer of the wrong size.
    #[error("tensor {name:?}: {ty} data for dims {dims:?} must be {expected} bytes, got {got}")]
    WrongDataSize {
        /// The tensor.
        name: String,
        /// Its type.
        ty: TensorType,
        /// Its dimensions.
        dims: Vec<u64>,
        /// Bytes the dims need.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// A shard of a split model that is not where its first shard says it is.
    #[error("shard {index} of {count} is missing: {path}: {source}")]
    MissingShard {
        /// Where it was looked for.
        path: PathBuf,
        /// Its number, from 1.
        index: u32,
        /// The number of shards.
        count: u32,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A file that does not belong to the split model it was opened as part of.
    #[error("{shard} is not a shard of this model: {problem}")]
    ForeignShard {
        /// The shard.
        shard: String,
        /// What does not match.
        problem: String,
    },
    /// A later shard of a split model opened in place of the first.
    #[error("{path} is shard {no} of {count} of a split model; open the first shard, {first}")]
    NotFirstShard {
        /// The file opened.
        path: PathBuf,
        /// Its number, from 1.
        no: u64,
        /// The number of shards.
        count: u32,
        /// The first shard's path.
        first: String,
    },
    /// A first shard not named as `gguf-split` names it, so the others cannot be found.
    #[error("{path} is the first shard of a split model, but its name does not end in {expected}, so the other shards cannot be found")]
    ShardName {
        /// The file.
        path: PathBuf,
        /// The ending its name needs.
        expected: String,
    },
    /// Shards that together hold another number of tensors than they declare.
    #[error("the {shards} shards hold {found} tensors, split.tensors.count says {expected}")]
    ShardTensorCount {
        /// What `split.tensors.count` says.
        expected: u64,
        /// What the shards hold.
        found: u64,
        /// The number of shards.
        shards: usize,
    },
}

/// Results of this crate.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
