//! Hostile and broken files: each is a clear error naming the problem, never a panic.

use std::time::Instant;

use ferrolm_gguf::{Array, GgufError, GgufFile, GgufWriter, TensorType, Value};

/// Hand-assembles GGUF bytes so that every field can be made wrong.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.bytes(key.as_bytes()).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.bytes(name.as_bytes()).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(&mut self, n: usize) -> Vec<u8> {
        let mut v = self.0.clone();
        v.resize(v.len().next_multiple_of(32) + n, 0x3c);
        v
    }
}

fn err(bytes: Vec<u8>) -> GgufError {
    GgufFile::from_bytes(bytes).expect_err("a broken file must not open")
}

fn valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()))
        .set("general.name", Value::String("tiny".into()))
        .set("llama.block_count", Value::U32(2))
        .set(
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(vec!["a".into(), "b".into()])),
        )
        .set(
            "nested",
            Value::Array(Array::Array(vec![
                Array::I32(vec![1, 2]),
                Array::I32(vec![3]),
            ])),
        );
    w.add_tensor("a", &[32, 2], TensorType::F32, vec![1; 256])
        .unwrap();
    w.add_tensor("b", &[32], TensorType::Q8_0, vec![2; 34])
        .unwrap();
    w.to_bytes()
}

#[test]
fn the_valid_file_opens() {
    let f = GgufFile::from_bytes(valid_file()).unwrap();
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(f.data("b").unwrap(), &[2u8; 34][..]);
}

#[test]
fn wrong_magic() {
    let mut b = valid_file();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(err(b), GgufError::BadMagic { .. }));
}

#[test]
fn unknown_versions() {
    for v in [0u32, 1, 4, 0xffff_ffff] {
        let mut b = valid_file();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(
            matches!(err(b), GgufError::UnsupportedVersion(x) if x == v),
            "version {v}"
        );
    }
    let mut b = valid_file();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(err(b), GgufError::BigEndian));
}

#[test]
fn version_2_is_read() {
    let mut b = valid_file();
    b[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(GgufFile::from_bytes(b).unwrap().version(), 2);
}

#[test]
fn truncated_at_every_length_is_an_error() {
    let full = valid_file();
    let f = GgufFile::from_bytes(full.clone()).unwrap();
    let header_end = f.data_offset() as usize;
    let data_end = f.tensors().iter().map(|t| t.offset + t.size).max().unwrap() as usize;
    // Cutting the padding after the last tensor leaves a valid file; any earlier cut does not.
    assert!(GgufFile::from_bytes(full[..header_end + data_end].to_vec()).is_ok());
    for len in 0..header_end + data_end {
        let e = err(full[..len].to_vec());
        let ok = if len < header_end {
            // Inside the header: the metadata or tensor infos are cut, or a count no longer fits.
            matches!(
                e,
                GgufError::Truncated { .. } | GgufError::CountTooLarge { .. }
            )
        } else {
            // Inside the data: some tensor reaches past the end.
            matches!(e, GgufError::DataOutOfBounds { .. })
        };
        assert!(ok, "cut at {len}: {e}");
    }
}

#[test]
fn truncation_names_the_part_that_is_cut() {
    let full = valid_file();
    // Cut inside the value of the last key, "nested".
    let pos = full.windows(6).position(|w| w == b"nested").unwrap();
    let e = err(full[..pos + 20].to_vec()).to_string();
    assert!(e.contains("nested") && e.contains("truncated"), "{e}");
    // Cut inside the tensor infos.
    let pos = full.windows(1).rposition(|w| w == b"b").unwrap();
    let e = err(full[..pos].to_vec()).to_string();
    assert!(e.contains("tensor"), "{e}");
}

#[test]
fn huge_tensor_count_is_refused_without_allocating() {
    let mut r = Raw::header(3, 1 << 60, 0);
    r.0.resize(60, 0);
    let start = Instant::now();
    let e = err(r.0);
    assert!(
        start.elapsed().as_millis() < 50,
        "took {:?}",
        start.elapsed()
    );
    assert!(
        matches!(e, GgufError::CountTooLarge { count, .. } if count == 1 << 60),
        "{e}"
    );
    assert!(e.to_string().contains("tensor count"));
}

#[test]
fn huge_metadata_and_array_counts_are_refused() {
    let r = Raw::header(3, 0, u64::MAX);
    assert!(matches!(err(r.0), GgufError::CountTooLarge { .. }));
    let mut r = Raw::header(3, 0, 1);
    r.bytes(b"arr").u32(9).u32(8).u64(1 << 62);
    let e = err(r.0);
    assert!(
        matches!(e, GgufError::CountTooLarge { .. }) && e.to_string().contains("arr"),
        "{e}"
    );
    let mut r = Raw::header(3, 0, 1);
    r.u64(u64::MAX).u64(0).u64(0); // a key longer than the file
    assert!(matches!(err(r.0), GgufError::Truncated { .. }));
}

#[test]
fn arrays_nested_too_deep() {
    let mut r = Raw::header(3, 0, 1);
    r.bytes(b"deep").u32(9);
    for _ in 0..10 {
        r.u32(9).u64(1);
    }
    r.u32(4).u64(0);
    assert!(matches!(err(r.0), GgufError::NestingTooDeep { .. }));
}

#[test]
fn unknown_metadata_value_type() {
    let mut r = Raw::header(3, 0, 1);
    r.bytes(b"k").u32(13).u32(0);
    assert!(matches!(
        err(r.0),
        GgufError::UnknownValueType { id: 13, .. }
    ));
}

#[test]
fn duplicate_keys_and_tensor_names() {
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("k", 1).kv_u32("k", 2);
    assert!(matches!(err(r.0), GgufError::DuplicateKey(k) if k == "k"));

    let mut r = Raw::header(3, 2, 0);
    r.tensor("t", &[32], 0, 0).tensor("t", &[32], 0, 128);
    assert!(matches!(err(r.data(256)), GgufError::DuplicateTensor(n) if n == "t"));
}

#[test]
fn tensor_data_outside_the_file() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[32], 0, 0);
    let e = err(r.data(100));
    assert!(
        matches!(
            e,
            GgufError::DataOutOfBounds {
                size: 128,
                data_len: 100,
                ..
            }
        ),
        "{e}"
    );

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[32], 0, u64::MAX - 31); // offset + size overflows
    assert!(matches!(
        err(r.data(128)),
        GgufError::DataOutOfBounds { .. }
    ));
}

#[test]
fn overlapping_tensors() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[64], 0, 0).tensor("b", &[32], 0, 128);
    let e = err(r.data(512));
    assert!(
        matches!(e, GgufError::Overlap { ref first, ref second } if first == "a" && second == "b"),
        "{e}"
    );
}

#[test]
fn dims_whose_product_overflows() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[1 << 32, 1 << 32], 0, 0);
    assert!(matches!(err(r.data(64)), GgufError::DimOverflow { .. }));
    // The element count fits, the byte count does not.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[1 << 62], 0, 0);
    assert!(matches!(err(r.data(64)), GgufError::DimOverflow { .. }));
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[1, 1, 1, 1, 1], 0, 0);
    assert!(matches!(
        err(r.data(64)),
        GgufError::TooManyDims { n_dims: 5, .. }
    ));
}

#[test]
fn unknown_tensor_type() {
    for id in [4u32, 31, 43, 1000] {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("t", &[32], id, 0);
        assert!(matches!(err(r.data(4096)), GgufError::UnknownTensorType { id: x, .. } if x == id));
    }
}

#[test]
fn rows_that_are_not_whole_blocks() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[33, 2], TensorType::Q4_0 as u32, 0);
    assert!(matches!(
        err(r.data(4096)),
        GgufError::NotWholeBlocks { ne0: 33, .. }
    ));
}

#[test]
fn misaligned_offsets() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 0, 4);
    assert!(matches!(
        err(r.data(256)),
        GgufError::MisalignedOffset {
            offset: 4,
            alignment: 32,
            ..
        }
    ));
    // With a larger declared alignment, 32 is misaligned too.
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("general.alignment", 64).tensor("t", &[8], 0, 32);
    assert!(matches!(
        err(r.data(256)),
        GgufError::MisalignedOffset { alignment: 64, .. }
    ));
}

#[test]
fn bad_alignment_values() {
    for a in [0u32, 3, 48] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", a);
        assert!(
            matches!(err(r.0), GgufError::BadAlignment(_)),
            "alignment {a}"
        );
    }
    let mut r = Raw::header(3, 0, 1);
    r.bytes(b"general.alignment").u32(8).bytes(b"32");
    assert!(matches!(err(r.0), GgufError::BadAlignment(_)));
}

#[test]
fn invalid_utf8_in_a_key_and_a_tensor_name() {
    let mut r = Raw::header(3, 0, 1);
    r.bytes(b"bad\xff\xfekey").u32(4).u32(1);
    let e = err(r.0);
    assert!(
        matches!(e, GgufError::InvalidUtf8 { .. }) && e.to_string().contains("key"),
        "{e}"
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t\u{0}", &[32], 0, 0);
    r.0[32] = 0xc3; // a lone lead byte in the name
    assert!(matches!(err(r.data(128)), GgufError::InvalidUtf8 { .. }));
}
