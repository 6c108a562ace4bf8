//! Writing GGUF version 3 files: metadata, tensor infos, aligned tensor data.

use std::io::{self, Write};
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::metadata::{Array, Metadata, Value};
use crate::reader::{tensor_extent, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use crate::TensorType;

/// Collects metadata and tensors, then writes them as one GGUF file.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Metadata,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: TensorType,
    data: Vec<u8>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Sets a metadata key (a later call replaces the value).
    pub fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.metadata.set(key, value);
        self
    }

    /// The metadata so far.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Adds a tensor; `dims` are GGML's order (the row length first) and `data` its bytes in
    /// the block layout of `ty`.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: TensorType,
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor(name));
        }
        let (_, expected) = tensor_extent(&name, dims, ty)?;
        if expected != data.len() as u64 {
            return Err(GgufError::WrongDataSize {
                name,
                ty,
                dims: dims.to_vec(),
                expected,
                got: data.len() as u64,
            });
        }
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ty,
            data,
        });
        Ok(self)
    }

    /// Removes the tensor `name`, if added; whether it was there (to replace a tensor with a
    /// broken one in tests of refusals).
    pub fn remove_tensor(&mut self, name: &str) -> bool {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        self.tensors.len() != before
    }

    fn alignment(&self) -> u64 {
        match self.metadata.get(ALIGNMENT_KEY) {
            Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => u64::from(*a),
            _ => DEFAULT_ALIGNMENT,
        }
    }

    /// Writes the file to `out`.
    pub fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        let alignment = self.alignment();
        let infos: Vec<_> = self
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.dims.as_slice(),
                    t.ty,
                    t.data.len() as u64,
                )
            })
            .collect();
        let mut w = Counting {
            inner: out,
            written: 0,
        };
        self.write_prefix(&infos, &mut w)?;
        for t in &self.tensors {
            w.write_all(&t.data)?;
            pad(&mut w, alignment)?;
        }
        w.flush()
    }

    /// For files too large to hold in memory: the header of a file with the metadata set
    /// here and the tensors `tensors`, whose data the caller writes itself. Tensors added
    /// with [`GgufWriter::add_tensor`] are an error here.
    pub fn header(&self, tensors: &[TensorLayout]) -> Result<GgufHeader> {
        if let Some(t) = self.tensors.first() {
            return Err(GgufError::DuplicateTensor(t.name.clone()));
        }
        let alignment = self.alignment();
        let mut names = std::collections::HashSet::new();
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors {
            if !names.insert(t.name.as_str()) {
                return Err(GgufError::DuplicateTensor(t.name.clone()));
            }
            sizes.push(tensor_extent(&t.name, &t.dims, t.ty)?.1);
        }
        let mut header = Vec::new();
        let infos: Vec<_> = tensors
            .iter()
            .zip(&sizes)
            .map(|(t, &size)| (t.name.as_str(), t.dims.as_slice(), t.ty, size))
            .collect();
        let mut counting = Counting {
            inner: &mut header,
            written: 0,
        };
        self.write_prefix(&infos, &mut counting)
            .expect("writing to a Vec cannot fail");
        let mut offsets = Vec::with_capacity(tensors.len());
        let mut at = header.len() as u64;
        for size in sizes {
            offsets.push(at);
            at = (at + size).next_multiple_of(alignment);
        }
        Ok(GgufHeader {
            bytes: header,
            offsets,
            file_len: at,
        })
    }

    /// Writes the file at `path`.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::create(path).map_err(io_err)?;
        let mut out = io::BufWriter::new(file);
        self.write_to(&mut out).map_err(io_err)
    }

    /// The file as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.write_to(&mut v).expect("writing to a Vec cannot fail");
        v
    }
}

impl GgufWriter {
    /// Magic, counts, metadata and the tensor infos (name, dims, type, data size), padded to
    /// the start of the data section.
    fn write_prefix<W: Write>(
        &self,
        tensors: &[(&str, &[u64], TensorType, u64)],
        w: &mut Counting<'_, W>,
    ) -> io::Result<()> {
        let alignment = self.alignment();
        w.write_all(&MAGIC)?;
        w.write_all(&3u32.to_le_bytes())?;
        w.write_all(&(tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in self.metadata.iter() {
            write_string(w, key)?;
            w.write_all(&(value.value_type() as u32).to_le_bytes())?;
            write_value(w, value)?;
        }
        let mut offset = 0u64;
        for &(name, dims, ty, size) in tensors {
            write_string(w, name)?;
            w.write_all(&(dims.len() as u32).to_le_bytes())?;
            for d in dims {
                w.write_all(&d.to_le_bytes())?;
            }
            w.write_all(&(ty as u32).to_le_bytes())?;
            w.write_all(&offset.to_le_bytes())?;
            offset = (offset + size).next_multiple_of(alignment);
        }
        pad(w, alignment)
    }
}

/// The start of a file whose tensor data is written separately ([`GgufWriter::header`]).
#[derive(Clone, Debug)]
pub struct GgufHeader {
    /// Magic, metadata and tensor infos, padded to the data section.
    pub bytes: Vec<u8>,
    /// Each tensor's data offset from the start of the file (aligned; zeros pad the gaps).
    pub offsets: Vec<u64>,
    /// The length of the whole file.
    pub file_len: u64,
}

/// A tensor whose data [`GgufWriter::header`]'s caller writes itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    /// The tensor's name.
    pub name: String,
    /// Dimensions in GGML order: the row length first.
    pub dims: Vec<u64>,
    /// The element type.
    pub ty: TensorType,
}

struct Counting<'a, W: Write> {
    inner: &'a mut W,
    written: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn pad<W: Write>(w: &mut Counting<'_, W>, alignment: u64) -> io::Result<()> {
    let target = w.written.next_multiple_of(alignment);
    let zeros = vec![0u8; (target - w.written) as usize];
    w.write_all(&zeros)
}

fn write_string(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, v: &Value) -> io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => write_string(w, s),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
        Value::Array(a) => write_array(w, a),
    }
}

fn write_array(w: &mut impl Write, a: &Array) -> io::Result<()> {
    w.write_all(&(a.element_type() as u32).to_le_bytes())?;
    w.write_all(&(a.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {{
            for x in $v {
                w.write_all(&x.to_le_bytes())?;
            }
            Ok(())
        }};
    }
    match a {
        Array::U8(v) => w.write_all(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => w.write_all(&v.iter().map(|&b| u8::from(b)).collect::<Vec<_>>()),
        Array::String(v) => {
            for s in v {
                write_string(w, s)?;
            }
            Ok(())
        }
        Array::Array(v) => {
            for inner in v {
                write_array(w, inner)?;
            }
            Ok(())
        }
    }
}
