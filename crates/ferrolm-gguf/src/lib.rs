//! GGUF files: a validated, zero-copy reader and a writer.
//!
//! [`GgufFile::open`] maps a file, parses its header with every count, length, offset and size
//! checked against the file length, and hands out tensor data as slices of the mapping. Nothing
//! in a file is trusted: a hostile file is a [`GgufError`] naming what is wrong, never a panic
//! or an allocation sized by the file. [`GgufWriter`] writes files that read back identically.
#![deny(unsafe_code)] // deny, not forbid: `memmap` below is the one reasoned exception
#![deny(missing_docs)]

mod error;
mod metadata;
mod reader;
mod tensor_type;
mod writer;

use std::path::Path;

pub use error::{GgufError, Result};
pub use metadata::{Array, Metadata, Value, ValueType};
pub use reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_DIMS};
pub use tensor_type::TensorType;
pub use writer::{GgufHeader, GgufWriter, TensorLayout};

/// Where a tensor's data is and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGML order: the row length first.
    pub dims: Vec<u64>,
    /// The element type.
    pub ty: TensorType,
    /// Offset of the data within the data section.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
    /// Number of elements.
    pub n_elements: u64,
}

impl TensorInfo {
    /// Elements per row (the first dimension).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (the product of the other dimensions).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

/// The bytes behind a file: a read-only mapping (and the open file, for reads that bypass it),
/// or a buffer (for tests and fuzzing).
enum Bytes {
    Mapped(memmap2::Mmap, std::fs::File),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m, _) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// An open GGUF file: its metadata, its tensor table and zero-copy access to tensor data.
pub struct GgufFile {
    bytes: Bytes,
    header: reader::Header,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.header.version)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        let mmap = memmap::map(&file).map_err(io_err)?;
        let header = reader::parse_header(&mmap)?;
        Ok(GgufFile {
            bytes: Bytes::Mapped(mmap, file),
            header,
        })
    }

    /// Validates a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        let header = reader::parse_header(&bytes)?;
        Ok(GgufFile {
            bytes: Bytes::Owned(bytes),
            header,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }

    /// The alignment of tensor data.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The tensor called `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensors.iter().find(|t| t.name == name)
    }

    /// The data of a tensor of this file (validated at open to lie within the file).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + info.offset) as usize;
        &self.bytes.as_slice()[start..start + info.size as usize]
    }

    /// The data of the tensor called `name`.
    pub fn data(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        Ok(self.tensor_data(info))
    }

    /// The whole file's bytes.
    pub fn file_bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// Fills `buf` with the file's bytes from `offset` on, reading the file (pread) rather than
    /// the mapping, so that the pages read never become part of this process's resident set
    /// (streamed expert weights rely on this); a file held in memory copies from its buffer.
    pub fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let len = self.bytes.as_slice().len() as u64;
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|end| end > len) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "{} bytes at offset {offset} lie beyond the file's {len} bytes",
                    buf.len()
                ),
            ));
        }
        match &self.bytes {
            #[cfg(unix)]
            Bytes::Mapped(_, file) => std::os::unix::fs::FileExt::read_exact_at(file, buf, offset),
            #[cfg(not(unix))]
            Bytes::Mapped(m, _) => {
                // No positioned read here: copy through the mapping (pages become resident).
                buf.copy_from_slice(&m[offset as usize..offset as usize + buf.len()]);
                Ok(())
            }
            Bytes::Owned(v) => {
                buf.copy_from_slice(&v[offset as usize..offset as usize + buf.len()]);
                Ok(())
            }
        }
    }
}

/// Parses and validates a GGUF header from bytes, without keeping them: the fuzz target.
pub fn validate(bytes: &[u8]) -> Result<()> {
    reader::parse_header(bytes).map(|_| ())
}

mod memmap {
    //! The one place that maps a file.
    //!
    //! Mapping is `unsafe` in memmap2 because another process could change the file under us;
    //! we map read-only and treat the bytes as untrusted input (the header is validated, tensor
    //! data is only ever read as numbers), so a concurrent writer cannot cause undefined
    //! behaviour here, only wrong numbers.
    #![allow(unsafe_code)] // the crate denies unsafe; this module is the reasoned exception

    pub(super) fn map(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
        // SAFETY: read-only mapping of a file we opened; see the module comment.
        unsafe { memmap2::Mmap::map(file) }
    }
}
