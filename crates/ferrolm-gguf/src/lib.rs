//! GGUF files: a validated, zero-copy reader and a writer.
//!
//! [`GgufFile::open`] maps a file, parses its header with every count, length, offset and size
//! checked against the file length, and hands out tensor data as slices of the mapping. Nothing
//! in a file is trusted: a hostile file is a [`GgufError`] naming what is wrong, never a panic
//! or an allocation sized by the file. A model split into shards (llama.cpp's `gguf-split`) opens
//! from its first shard as one file whose tensors lie in several ([`GgufFile::shards`]).
//! [`GgufWriter`] writes files that read back identically.
#![deny(unsafe_code)] // deny, not forbid: `memmap` below and `joined` are the reasoned exceptions
#![deny(missing_docs)]

mod error;
mod joined;
mod metadata;
mod reader;
mod split;
mod tensor_type;
mod writer;

use std::path::Path;

pub use error::{GgufError, Result};
pub use metadata::{Array, Metadata, Value, ValueType};
pub use reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_DIMS};
pub use split::{
    shard_path, shard_suffix, write_split, Shard, SHARD_ALIGN, SPLIT_COUNT_KEY, SPLIT_NO_KEY,
    SPLIT_TENSORS_COUNT_KEY,
};
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
    /// Offset of the data within the data section (of a split model: from the first shard's
    /// data section to the tensor's bytes in the shards' joined bytes).
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
/// the shards of a split model mapped side by side (and their files), or a buffer (for tests
/// and fuzzing).
enum Bytes {
    Mapped(memmap2::Mmap, std::fs::File),
    Joined(joined::JoinedMap, Vec<std::fs::File>),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m, _) => m,
            Bytes::Joined(m, _) => m.as_slice(),
            Bytes::Owned(v) => v,
        }
    }
}

/// An open GGUF file: its metadata, its tensor table and zero-copy access to tensor data.
pub struct GgufFile {
    bytes: Bytes,
    header: reader::Header,
    shards: Vec<Shard>,
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
    /// Maps and validates the file at `path`; the first shard of a split model opens every
    /// shard (named as `gguf-split` names them, beside it) as one model.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let (file, mmap, header) = open_one(path)?;
        let count = split::shard_count(&header)?;
        let no = header.metadata.opt_u64(SPLIT_NO_KEY)?.unwrap_or(0);
        if no != 0 {
            // The name tells where the first shard is when it follows gguf-split's pattern.
            let suffix_of_first = shard_suffix(0, count);
            let first = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| {
                    let prefix = n.strip_suffix(&shard_suffix(u32::try_from(no).ok()?, count))?;
                    Some(path.with_file_name(format!("{prefix}{suffix_of_first}")))
                })
                .map_or_else(
                    || format!("the file whose name ends in {suffix_of_first}"),
                    |p| p.display().to_string(),
                );
            return Err(GgufError::NotFirstShard {
                path: path.to_path_buf(),
                no: no.saturating_add(1),
                count,
                first,
            });
        }
        if count == 1 {
            let len = mmap.len() as u64;
            return Ok(GgufFile {
                shards: vec![Shard {
                    path: Some(path.to_path_buf()),
                    file_len: len,
                    n_tensors: header.tensors.len(),
                    base: 0,
                }],
                bytes: Bytes::Mapped(mmap, file),
                header,
            });
        }
        let mut files = vec![file];
        let mut headers = vec![header];
        let mut lens = vec![mmap.len() as u64];
        let mut paths = vec![path.to_path_buf()];
        drop(mmap);
        for k in 1..count {
            let shard = shard_path(path, k, count)?;
            let (file, mmap, header) = open_one(&shard).map_err(|e| match e {
                GgufError::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => {
                    GgufError::MissingShard {
                        path,
                        index: k + 1,
                        count,
                        source,
                    }
                }
                e => e,
            })?;
            files.push(file);
            headers.push(header);
            lens.push(mmap.len() as u64);
            paths.push(shard);
        }
        let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        let (header, shards, total) = split::join(
            headers,
            &lens,
            &names,
            paths.into_iter().map(Some).collect(),
        )?;
        let parts: Vec<_> = files
            .iter()
            .zip(&shards)
            .map(|(f, s)| (f, s.base, s.file_len))
            .collect();
        let map = joined::JoinedMap::map(total, &parts).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(GgufFile {
            bytes: Bytes::Joined(map, files),
            header,
            shards,
        })
    }

    /// Validates a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        let header = reader::parse_header(&bytes)?;
        Ok(GgufFile {
            shards: vec![Shard {
                path: None,
                file_len: bytes.len() as u64,
                n_tensors: header.tensors.len(),
                base: 0,
            }],
            bytes: Bytes::Owned(bytes),
            header,
        })
    }

    /// Validates the shards of a split model held in memory, in order, as one model; their
    /// bytes are laid out as [`GgufFile::open`] maps them.
    pub fn from_shards(shards: &[&[u8]]) -> Result<GgufFile> {
        let Some(first) = shards.first() else {
            return Err(GgufError::ForeignShard {
                shard: "shard #1".into(),
                problem: "no shards given".into(),
            });
        };
        let first_header = reader::parse_header(first)?;
        let count = split::shard_count(&first_header)?;
        if count as usize != shards.len() {
            return Err(GgufError::ForeignShard {
                shard: "shard #1".into(),
                problem: format!("{SPLIT_COUNT_KEY} is {count}, {} given", shards.len()),
            });
        }
        if count == 1 {
            return GgufFile::from_bytes(first.to_vec());
        }
        let mut headers = vec![first_header];
        for s in &shards[1..] {
            headers.push(reader::parse_header(s)?);
        }
        let lens: Vec<u64> = shards.iter().map(|s| s.len() as u64).collect();
        let names: Vec<String> = (1..=shards.len()).map(|k| format!("shard #{k}")).collect();
        let (header, table, total) = split::join(headers, &lens, &names, vec![None; shards.len()])?;
        let mut bytes = vec![0u8; total as usize];
        for (s, t) in shards.iter().zip(&table) {
            bytes[t.base as usize..t.base as usize + s.len()].copy_from_slice(s);
        }
        Ok(GgufFile {
            bytes: Bytes::Owned(bytes),
            header,
            shards: table,
        })
    }

    /// The files the model is made of: one, or its shards in order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
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

    /// The whole file's bytes (of a split model: the shards side by side, each at its
    /// [`Shard::base`], zeros between them).
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
            #[cfg(unix)]
            Bytes::Joined(_, files) => {
                // The shard holding `offset`; a read may not run past its end.
                let k = self.shards.partition_point(|s| s.base <= offset) - 1;
                let s = &self.shards[k];
                let within = offset - s.base;
                if within + buf.len() as u64 > s.file_len {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "{} bytes at offset {offset} cross the end of shard {}",
                            buf.len(),
                            k + 1
                        ),
                    ));
                }
                std::os::unix::fs::FileExt::read_exact_at(&files[k], buf, within)
            }
            #[cfg(not(unix))]
            Bytes::Joined(m, _) => {
                buf.copy_from_slice(&m.as_slice()[offset as usize..offset as usize + buf.len()]);
                Ok(())
            }
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

/// Opens, maps and validates one file.
fn open_one(path: &Path) -> Result<(std::fs::File, memmap2::Mmap, reader::Header)> {
    let io_err = |source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io_err)?;
    let mmap = memmap::map(&file).map_err(io_err)?;
    let header = reader::parse_header(&mmap)?;
    Ok((file, mmap, header))
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
