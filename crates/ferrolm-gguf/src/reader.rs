//! Parsing the header of a GGUF file: every count and size checked against the bytes present.

use std::collections::HashSet;

use crate::error::{GgufError, Result};
use crate::metadata::{Array, Metadata, Value, ValueType};
use crate::{TensorInfo, TensorType};

/// `GGUF` read as a little-endian u32.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// GGML's limit on tensor dimensions.
pub const MAX_DIMS: u32 = 4;
/// How deep arrays of arrays may nest.
const MAX_NESTING: usize = 4;

/// Everything before the tensor data.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Where the data section starts in the file.
    pub data_offset: u64,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                need: n,
                have: self.remaining(),
            });
        }
        let start = self.pos;
        self.pos += n as usize; // n <= remaining, so it fits in usize
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let b = self.take(N as u64, what)?;
        Ok(b.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_bytes` long, refused when the rest of the file could
    /// not hold that many: this is what keeps a hostile count from becoming an allocation.
    fn count(&mut self, min_bytes: u64, what: &dyn Fn() -> String) -> Result<usize> {
        let count = self.u64(what)?;
        let fits = count
            .checked_mul(min_bytes.max(1))
            .is_some_and(|total| total <= self.remaining());
        if !fits {
            return Err(GgufError::CountTooLarge {
                what: what(),
                count,
                remaining: self.remaining(),
            });
        }
        Ok(count as usize) // bounded by the file length
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let offset = self.pos as u64;
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what(),
            offset,
        })
    }
}

pub(crate) fn parse_header(bytes: &[u8]) -> Result<Header> {
    if bytes.len() < 4 {
        return Err(GgufError::Truncated {
            what: "magic".into(),
            offset: 0,
            need: 4,
            have: bytes.len() as u64,
        });
    }
    if bytes[..4] != MAGIC {
        return Err(GgufError::BadMagic {
            found: bytes[..4].to_vec(),
        });
    }
    let mut c = Cursor { bytes, pos: 4 };
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        // A big-endian file stores version 3 as 0x03000000.
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            return Err(GgufError::BigEndian);
        }
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors_raw = c.u64(&|| "tensor count".into())?;
    // The smallest tensor info: empty name (8), n_dims (4), type (4), offset (8).
    const MIN_TENSOR_INFO: u64 = 24;
    // The smallest metadata entry: empty key (8), type (4), one-byte value.
    const MIN_KV: u64 = 13;
    let n_kv = c.count(MIN_KV, &|| "metadata key count".into())?;
    let n_tensors = check_count(n_tensors_raw, MIN_TENSOR_INFO, &c, "tensor count")?;

    let mut metadata = Metadata::default();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let value = read_value_with_type(&mut c, &key, 0)?;
        metadata.insert(key, value)?;
    }

    let alignment = match metadata.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => u64::from(*a),
        Some(v) => {
            return Err(GgufError::BadAlignment(format!(
                "{} {v}",
                v.type_description()
            )))
        }
    };

    // Recheck the tensor count now that the metadata has been consumed.
    let n_tensors = check_count(n_tensors as u64, MIN_TENSOR_INFO, &c, "tensor count")?;
    let mut tensors = Vec::with_capacity(reservation(n_tensors));
    let mut names = HashSet::with_capacity(reservation(n_tensors));
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor #{i} name"))?;
        let n_dims = c.u32(&|| format!("tensor {name:?} dimension count"))?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(c.u64(&|| format!("tensor {name:?} dimension {d}"))?);
        }
        let type_id = c.u32(&|| format!("tensor {name:?} type"))?;
        let offset = c.u64(&|| format!("tensor {name:?} offset"))?;
        let ty = TensorType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            name: name.clone(),
            id: type_id,
        })?;
        let (n_elements, size) = tensor_extent(&name, &dims, ty)?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedOffset {
                name,
                offset,
                alignment,
            });
        }
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor(name));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            size,
            n_elements,
        });
    }

    let header_end = c.pos as u64;
    let data_offset = header_end.next_multiple_of(alignment);
    let file_len = bytes.len() as u64;
    let data_len = file_len.saturating_sub(data_offset);
    if !tensors.is_empty() && data_offset > file_len {
        return Err(GgufError::Truncated {
            what: "padding before tensor data".into(),
            offset: header_end,
            need: data_offset - header_end,
            have: file_len - header_end,
        });
    }
    check_tensor_data(&tensors, data_len)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// The element count and byte size of a tensor of `ty` with `dims`: rows must be whole
/// blocks, and neither number may overflow (GGML counts elements in an i64).
pub(crate) fn tensor_extent(name: &str, dims: &[u64], ty: TensorType) -> Result<(u64, u64)> {
    let overflow = || GgufError::DimOverflow {
        name: name.to_string(),
        dims: dims.to_vec(),
    };
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(overflow)?;
    let ne0 = dims.first().copied().unwrap_or(1);
    if !ne0.is_multiple_of(ty.block_size() as u64) {
        return Err(GgufError::NotWholeBlocks {
            name: name.to_string(),
            ty,
            ne0,
            block: ty.block_size(),
        });
    }
    let size = ty.bytes_for(n_elements).ok_or_else(overflow)?;
    Ok((n_elements, size))
}

/// Entries reserved up front for a count read from the file. A count passes [`check_count`]
/// against the bytes left, but each entry's in-memory form (a `String`, a `TensorInfo`) is
/// several times its smallest encoding: beyond this many, vectors grow with what is parsed.
const MAX_RESERVATION: usize = 4096;

fn reservation(count: usize) -> usize {
    count.min(MAX_RESERVATION)
}

fn check_count(count: u64, min_bytes: u64, c: &Cursor<'_>, what: &str) -> Result<usize> {
    if count
        .checked_mul(min_bytes)
        .is_none_or(|total| total > c.remaining())
    {
        return Err(GgufError::CountTooLarge {
            what: what.into(),
            count,
            remaining: c.remaining(),
        });
    }
    Ok(count as usize)
}

/// Every tensor inside the data section, and no two overlapping.
fn check_tensor_data(tensors: &[TensorInfo], data_len: u64) -> Result<()> {
    for t in tensors {
        if t.offset
            .checked_add(t.size)
            .is_none_or(|end| end > data_len)
        {
            return Err(GgufError::DataOutOfBounds {
                name: t.name.clone(),
                offset: t.offset,
                size: t.size,
                data_len,
            });
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.size > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(GgufError::Overlap {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}

fn read_value_with_type(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<Value> {
    let id = c.u32(&|| format!("type of metadata key {key:?}"))?;
    let ty = ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_string(),
        id,
    })?;
    read_value(c, key, ty, depth)
}

fn read_value(c: &mut Cursor<'_>, key: &str, ty: ValueType, depth: usize) -> Result<Value> {
    let what = || format!("value of metadata key {key:?}");
    Ok(match ty {
        ValueType::U8 => Value::U8(c.array::<1>(&what)?[0]),
        ValueType::I8 => Value::I8(c.array::<1>(&what)?[0] as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        ValueType::U32 => Value::U32(c.u32(&what)?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        ValueType::Bool => Value::Bool(c.array::<1>(&what)?[0] != 0),
        ValueType::String => Value::String(c.string(&what)?),
        ValueType::U64 => Value::U64(c.u64(&what)?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        ValueType::Array => Value::Array(read_array(c, key, depth)?),
    })
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<Array> {
    if depth >= MAX_NESTING {
        return Err(GgufError::NestingTooDeep {
            key: key.to_string(),
            max: MAX_NESTING,
        });
    }
    let id = c.u32(&|| format!("element type of metadata array {key:?}"))?;
    let ty = ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_string(),
        id,
    })?;
    let n = c.count(ty.min_bytes(), &|| {
        format!("length of metadata array {key:?}")
    })?;
    let what = || format!("element of metadata array {key:?}");

    /// Reads `n` fixed-size little-endian numbers in one slice.
    macro_rules! numbers {
        ($variant:ident, $t:ty) => {{
            const W: usize = std::mem::size_of::<$t>();
            let raw = c.take((n * W) as u64, &what)?;
            Array::$variant(
                raw.chunks_exact(W)
                    .map(|b| <$t>::from_le_bytes(b.try_into().expect("chunk of W bytes")))
                    .collect(),
            )
        }};
    }
    Ok(match ty {
        ValueType::U8 => Array::U8(c.take(n as u64, &what)?.to_vec()),
        ValueType::I8 => Array::I8(c.take(n as u64, &what)?.iter().map(|&b| b as i8).collect()),
        ValueType::Bool => Array::Bool(c.take(n as u64, &what)?.iter().map(|&b| b != 0).collect()),
        ValueType::U16 => numbers!(U16, u16),
        ValueType::I16 => numbers!(I16, i16),
        ValueType::U32 => numbers!(U32, u32),
        ValueType::I32 => numbers!(I32, i32),
        ValueType::F32 => numbers!(F32, f32),
        ValueType::U64 => numbers!(U64, u64),
        ValueType::I64 => numbers!(I64, i64),
        ValueType::F64 => numbers!(F64, f64),
        ValueType::String => {
            let mut v = Vec::with_capacity(reservation(n));
            for _ in 0..n {
                v.push(c.string(&what)?);
            }
            Array::String(v)
        }
        ValueType::Array => {
            let mut v = Vec::with_capacity(reservation(n));
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            Array::Array(v)
        }
    })
}
