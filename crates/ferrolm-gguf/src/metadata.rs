//! Metadata values and typed access to them.

use std::collections::HashMap;
use std::fmt;

use crate::error::{GgufError, Result};

/// The type ids of metadata values, as GGUF numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    /// `u8`
    U8 = 0,
    /// `i8`
    I8 = 1,
    /// `u16`
    U16 = 2,
    /// `i16`
    I16 = 3,
    /// `u32`
    U32 = 4,
    /// `i32`
    I32 = 5,
    /// `f32`
    F32 = 6,
    /// `bool` (one byte, 0 or 1)
    Bool = 7,
    /// length-prefixed UTF-8 string
    String = 8,
    /// typed array
    Array = 9,
    /// `u64`
    U64 = 10,
    /// `i64`
    I64 = 11,
    /// `f64`
    F64 = 12,
}

impl ValueType {
    /// The type with id `id`, if known.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The smallest number of bytes one value of this type takes in a file.
    pub(crate) fn min_bytes(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // each variant holds the type it names
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: every element has one type, so each is stored as a plain vector.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // each variant holds the type it names
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    /// The GGUF type of this value.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A description of the type for error messages: `u32`, `array of string`, ...
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.element_description()),
            v => v.value_type().name().to_string(),
        }
    }

    /// The value as an integer, when it is one of the integer types.
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

impl Array {
    /// The GGUF type of the elements.
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn element_description(&self) -> String {
        match self {
            Array::Array(inner) => match inner.first() {
                Some(first) => format!("array of {}", first.element_description()),
                None => "array".to_string(),
            },
            a => a.element_type().name().to_string(),
        }
    }

    /// The elements as integers (any integer element type), for keys whose writers disagree on
    /// the width.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(match self {
            Array::U8(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I8(v) => v.iter().map(|&x| x.into()).collect(),
            Array::U16(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I16(v) => v.iter().map(|&x| x.into()).collect(),
            Array::U32(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I32(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I64(v) => v.clone(),
            Array::U64(v) => v
                .iter()
                .map(|&x| i64::try_from(x).ok())
                .collect::<Option<_>>()?,
            Array::Bool(v) => v.iter().map(|&x| x.into()).collect(),
            _ => return None,
        })
    }
}

impl fmt::Display for Value {
    /// Scalars in full; arrays of more than eight elements summarized.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(v) => write!(f, "{v:?}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Array(a) => write!(f, "{a}"),
        }
    }
}

impl fmt::Display for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        fn list<T: fmt::Debug>(f: &mut fmt::Formatter<'_>, v: &[T]) -> fmt::Result {
            let head: Vec<String> = v.iter().take(SHOWN).map(|x| format!("{x:?}")).collect();
            write!(f, "[{}", head.join(", "))?;
            if v.len() > SHOWN {
                write!(f, ", ... ({} elements)", v.len())?;
            }
            write!(f, "]")
        }
        match self {
            Array::U8(v) => list(f, v),
            Array::I8(v) => list(f, v),
            Array::U16(v) => list(f, v),
            Array::I16(v) => list(f, v),
            Array::U32(v) => list(f, v),
            Array::I32(v) => list(f, v),
            Array::F32(v) => list(f, v),
            Array::Bool(v) => list(f, v),
            Array::String(v) => list(f, v),
            Array::U64(v) => list(f, v),
            Array::I64(v) => list(f, v),
            Array::F64(v) => list(f, v),
            Array::Array(v) => {
                let head: Vec<String> = v.iter().take(SHOWN).map(|x| x.to_string()).collect();
                write!(f, "[{}", head.join(", "))?;
                if v.len() > SHOWN {
                    write!(f, ", ... ({} elements)", v.len())?;
                }
                write!(f, "]")
            }
        }
    }
}

/// The metadata of a file: keys in file order, with lookup by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

macro_rules! integer_getters {
    ($($(#[$doc:meta])* $get:ident, $opt:ident, $t:ty;)*) => {$(
        $(#[$doc])*
        pub fn $get(&self, key: &str) -> Result<$t> {
            self.$opt(key)?.ok_or_else(|| GgufError::MissingKey(key.to_string()))
        }

        /// Like the getter without `opt_`, but `Ok(None)` when the key is absent.
        pub fn $opt(&self, key: &str) -> Result<Option<$t>> {
            let Some(v) = self.get(key) else { return Ok(None) };
            v.as_i128()
                .and_then(|i| <$t>::try_from(i).ok())
                .map(Some)
                .ok_or_else(|| wrong_type(key, stringify!($t), v))
        }
    )*};
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    let found = match found.as_i128() {
        Some(i) => format!("{} (value {i})", found.type_description()),
        None => found.type_description(),
    };
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found,
    }
}

impl Metadata {
    /// Adds a key; an existing key is an error, as in a file.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) -> Result<()> {
        let key = key.into();
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    /// Sets a key, replacing any earlier value.
    pub fn set(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// All entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    integer_getters! {
        /// An integer key that fits in `u32` (any integer type in the file).
        get_u32, opt_u32, u32;
        /// An integer key that fits in `u64` (any integer type in the file).
        get_u64, opt_u64, u64;
        /// An integer key that fits in `i32` (any integer type in the file).
        get_i32, opt_i32, i32;
        /// An integer key that fits in `i64` (any integer type in the file).
        get_i64, opt_i64, i64;
    }

    /// A floating-point key (`f32`, or `f64` narrowed).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.opt_f32(key)?
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// Like [`Metadata::get_f32`], but `Ok(None)` when the key is absent.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(*v)),
            Some(Value::F64(v)) => Ok(Some(*v as f32)),
            Some(v) => Err(wrong_type(key, "f32", v)),
        }
    }

    /// A boolean key.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.opt_bool(key)?
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// Like [`Metadata::get_bool`], but `Ok(None)` when the key is absent.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(v) => Err(wrong_type(key, "bool", v)),
        }
    }

    /// A string key.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// Like [`Metadata::get_str`], but `Ok(None)` when the key is absent.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(v)) => Ok(Some(v)),
            Some(v) => Err(wrong_type(key, "string", v)),
        }
    }

    /// An array key of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        self.opt_array(key)?
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// Like [`Metadata::get_array`], but `Ok(None)` when the key is absent.
    pub fn opt_array(&self, key: &str) -> Result<Option<&Array>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(wrong_type(key, "array", v)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key)? {
            Array::String(v) => Ok(v),
            _ => Err(wrong_type(
                key,
                "array of string",
                self.get(key).expect("present"),
            )),
        }
    }

    /// An array of `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        match self.get_array(key)? {
            Array::F32(v) => Ok(v),
            _ => Err(wrong_type(
                key,
                "array of f32",
                self.get(key).expect("present"),
            )),
        }
    }

    /// An array of integers of any width, widened to `i64`.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>> {
        let a = self.get_array(key)?;
        a.to_i64_vec()
            .ok_or_else(|| wrong_type(key, "array of integers", self.get(key).expect("present")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Metadata {
        let mut m = Metadata::default();
        m.insert("a.u32", Value::U32(7)).unwrap();
        m.insert("a.i32neg", Value::I32(-1)).unwrap();
        m.insert("a.u64big", Value::U64(u64::MAX)).unwrap();
        m.insert("a.str", Value::String("x".into())).unwrap();
        m.insert(
            "a.arr",
            Value::Array(Array::String(vec!["p".into(), "q".into()])),
        )
        .unwrap();
        m
    }

    #[test]
    fn typed_getters_convert_integers_that_fit() {
        let m = sample();
        assert_eq!(m.get_u32("a.u32").unwrap(), 7);
        assert_eq!(m.get_u64("a.u32").unwrap(), 7);
        assert_eq!(m.get_i64("a.i32neg").unwrap(), -1);
        assert_eq!(m.get_u64("a.u64big").unwrap(), u64::MAX);
        assert_eq!(m.get_str_array("a.arr").unwrap(), ["p", "q"]);
        assert_eq!(m.opt_u32("absent").unwrap(), None);
    }

    #[test]
    fn errors_name_the_key_and_the_type_found() {
        let m = sample();
        let e = m.get_u32("a.str").unwrap_err().to_string();
        assert!(
            e.contains("a.str") && e.contains("string") && e.contains("u32"),
            "{e}"
        );
        let e = m.get_u32("a.i32neg").unwrap_err().to_string();
        assert!(e.contains("i32") && e.contains("-1"), "{e}");
        let e = m.get_u32("a.u64big").unwrap_err().to_string();
        assert!(e.contains("u64"), "{e}");
        let e = m.get_f32_array("a.arr").unwrap_err().to_string();
        assert!(e.contains("array of string"), "{e}");
        let e = m.get_str("nope").unwrap_err().to_string();
        assert!(e.contains("nope") && e.contains("missing"), "{e}");
        assert!(matches!(
            sample().insert("a.u32", Value::U8(1)),
            Err(GgufError::DuplicateKey(_))
        ));
    }
}
