//! Models split into shards by llama.cpp's `gguf-split`: `NAME-00001-of-00003.gguf`, ...
//!
//! The first shard holds the model's metadata; every shard carries `split.no` (its index from 0),
//! `split.count` and `split.tensors.count` (the tensors of all shards together). The shards are
//! validated one by one as GGUF files, then as one model, and placed one after another in one
//! address space, each starting on a [`SHARD_ALIGN`] boundary, so that a tensor's offset from the
//! first shard's data section names its bytes whichever shard holds them.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::reader::{Header, ALIGNMENT_KEY};
use crate::{GgufFile, GgufWriter, TensorLayout, Value};

/// The key holding a shard's index (from 0).
pub const SPLIT_NO_KEY: &str = "split.no";
/// The key holding the number of shards.
pub const SPLIT_COUNT_KEY: &str = "split.count";
/// The key holding the number of tensors in all shards together.
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";
/// Where shards start in the joined address space: a multiple of every page size in use
/// (4 KiB, 16 KiB, 64 KiB), as mapping a file at a fixed address requires.
pub const SHARD_ALIGN: u64 = 1 << 16;

/// One file of a model, as opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The file (absent for a model held in memory).
    pub path: Option<PathBuf>,
    /// Its length in bytes.
    pub file_len: u64,
    /// The tensors it holds.
    pub n_tensors: usize,
    /// Where it starts in the model's joined bytes.
    pub base: u64,
}

/// The number of shards a file's metadata declares (1 for an unsplit file).
pub(crate) fn shard_count(header: &Header) -> Result<u32> {
    match header.metadata.opt_u32(SPLIT_COUNT_KEY)? {
        None => Ok(1),
        Some(0) => Err(GgufError::ForeignShard {
            shard: "the first shard".into(),
            problem: format!("{SPLIT_COUNT_KEY} is 0"),
        }),
        Some(n) => Ok(n),
    }
}

/// The path of shard `no` (from 0) of `count` next to `first`, which must be named as
/// `gguf-split` names shard 1 (`PREFIX-00001-of-000NN.gguf`).
pub fn shard_path(first: &Path, no: u32, count: u32) -> Result<PathBuf> {
    let suffix = shard_suffix(0, count);
    let name = first.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let prefix = name
        .strip_suffix(&suffix)
        .filter(|p| !p.is_empty())
        .ok_or_else(|| GgufError::ShardName {
            path: first.to_path_buf(),
            expected: format!("...{suffix}"),
        })?;
    Ok(first.with_file_name(format!("{prefix}{}", shard_suffix(no, count))))
}

/// `-00002-of-00003.gguf` for shard `no` = 1 of 3.
pub fn shard_suffix(no: u32, count: u32) -> String {
    format!("-{:05}-of-{count:05}.gguf", u64::from(no) + 1)
}

/// Where each of shards of `lens` bytes starts when they are laid end to end, each on a
/// [`SHARD_ALIGN`] boundary, and the total length; `None` if that overflows.
pub(crate) fn layout(lens: &[u64]) -> Option<(Vec<u64>, u64)> {
    let mut bases = Vec::with_capacity(lens.len());
    let mut at = 0u64;
    for &len in lens {
        bases.push(at);
        at = at.checked_add(len)?.checked_next_multiple_of(SHARD_ALIGN)?;
    }
    Some((bases, at))
}

/// Checks that `headers` (with the files' lengths and names, for errors) are the shards of one
/// model, in order, and merges them into the model's header: the first shard's metadata, every
/// shard's tensors with offsets into the joined bytes. Returns it with the shards' table and
/// the joined bytes' length.
pub(crate) fn join(
    headers: Vec<Header>,
    lens: &[u64],
    names: &[String],
    paths: Vec<Option<PathBuf>>,
) -> Result<(Header, Vec<Shard>, u64)> {
    let count = headers.len();
    // A shard without tensors may end before its (empty) data section would start.
    let extents: Vec<u64> = headers
        .iter()
        .zip(lens)
        .map(|(h, &len)| len.max(h.data_offset))
        .collect();
    let (bases, total) = layout(&extents).ok_or_else(|| GgufError::ForeignShard {
        shard: names[0].clone(),
        problem: "the shards' lengths overflow".into(),
    })?;
    let first = &headers[0];
    let expected_tensors = first.metadata.opt_u64(SPLIT_TENSORS_COUNT_KEY)?;
    let mut tensors = Vec::new();
    let mut seen = HashSet::new();
    let mut shards = Vec::with_capacity(count);
    for (k, ((h, path), &base)) in headers.iter().zip(paths).zip(&bases).enumerate() {
        let foreign = |problem: String| GgufError::ForeignShard {
            shard: names[k].clone(),
            problem,
        };
        let no = h.metadata.opt_u64(SPLIT_NO_KEY)?;
        if no != Some(k as u64) {
            return Err(foreign(format!(
                "{SPLIT_NO_KEY} is {}, expected {k} (shards count from 0)",
                show(no)
            )));
        }
        let n = h.metadata.opt_u64(SPLIT_COUNT_KEY)?;
        if n != Some(count as u64) {
            return Err(foreign(format!(
                "{SPLIT_COUNT_KEY} is {}, the first shard says {count}",
                show(n)
            )));
        }
        let t = h.metadata.opt_u64(SPLIT_TENSORS_COUNT_KEY)?;
        if t != expected_tensors {
            return Err(foreign(format!(
                "{SPLIT_TENSORS_COUNT_KEY} is {}, the first shard says {}",
                show(t),
                show(expected_tensors)
            )));
        }
        // From the first shard's data section to this tensor's bytes in the joined space.
        let shift = base
            .checked_add(h.data_offset)
            .and_then(|x| x.checked_sub(first.data_offset))
            .ok_or_else(|| foreign("its data section lies before the first shard's".into()))?;
        for info in &h.tensors {
            if !seen.insert(info.name.as_str()) {
                return Err(GgufError::DuplicateTensor(info.name.clone()));
            }
            let mut info = info.clone();
            info.offset = info
                .offset
                .checked_add(shift)
                .ok_or_else(|| foreign(format!("tensor {:?}'s offset overflows", info.name)))?;
            tensors.push(info);
        }
        shards.push(Shard {
            path,
            file_len: lens[k],
            n_tensors: h.tensors.len(),
            base,
        });
    }
    if let Some(expected) = expected_tensors {
        if expected != tensors.len() as u64 {
            return Err(GgufError::ShardTensorCount {
                expected,
                found: tensors.len() as u64,
                shards: count,
            });
        }
    }
    let header = Header {
        version: first.version,
        metadata: first.metadata.clone(),
        tensors,
        alignment: first.alignment,
        data_offset: first.data_offset,
    };
    Ok((header, shards, total))
}

fn show(v: Option<u64>) -> String {
    v.map_or_else(|| "absent".to_string(), |v| v.to_string())
}

/// Writes the model `src` as shards of at most `max_tensors` tensors each, named as
/// `gguf-split` names them (`PREFIX-00001-of-000NN.gguf` beside `prefix`), and returns their
/// paths. The first shard carries the metadata; every shard the split keys (and the alignment,
/// if the model sets one). Tensor data is copied straight from `src`, one tensor at a time.
pub fn write_split(src: &GgufFile, prefix: &Path, max_tensors: usize) -> Result<Vec<PathBuf>> {
    let tensors = src.tensors();
    let per_shard = max_tensors.max(1);
    let count = tensors.len().div_ceil(per_shard).max(1);
    let too_many = || GgufError::ForeignShard {
        shard: prefix.display().to_string(),
        problem: format!("{count} shards or {} tensors are too many", tensors.len()),
    };
    let count16 = u16::try_from(count).map_err(|_| too_many())?;
    let n_tensors = i32::try_from(tensors.len()).map_err(|_| too_many())?;
    let name = prefix
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("model");
    let mut paths = Vec::with_capacity(count);
    for k in 0..count {
        let mut w = GgufWriter::new();
        if k == 0 {
            for (key, value) in src.metadata().iter() {
                if !key.starts_with("split.") {
                    w.set(key, value.clone());
                }
            }
        } else if let Some(a) = src.metadata().get(ALIGNMENT_KEY) {
            w.set(ALIGNMENT_KEY, a.clone());
        }
        w.set(SPLIT_NO_KEY, Value::U16(k as u16));
        w.set(SPLIT_COUNT_KEY, Value::U16(count16));
        w.set(SPLIT_TENSORS_COUNT_KEY, Value::I32(n_tensors));
        let part = tensors.chunks(per_shard).nth(k).unwrap_or(&[]);
        let layouts: Vec<TensorLayout> = part
            .iter()
            .map(|t| TensorLayout {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ty: t.ty,
            })
            .collect();
        let header = w.header(&layouts)?;
        let path = prefix.with_file_name(format!("{name}{}", shard_suffix(k as u32, count as u32)));
        let io_err = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path).map_err(io_err)?);
        out.write_all(&header.bytes).map_err(io_err)?;
        let mut at = header.bytes.len() as u64;
        for (t, &offset) in part.iter().zip(&header.offsets) {
            std::io::copy(&mut std::io::repeat(0).take(offset - at), &mut out).map_err(io_err)?;
            out.write_all(src.tensor_data(t)).map_err(io_err)?;
            at = offset + t.size;
        }
        std::io::copy(&mut std::io::repeat(0).take(header.file_len - at), &mut out)
            .map_err(io_err)?;
        out.flush().map_err(io_err)?;
        paths.push(path);
    }
    Ok(paths)
}
