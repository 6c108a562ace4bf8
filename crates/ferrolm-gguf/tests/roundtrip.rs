//! Files written by the writer read back identical, and rewrite to the same bytes.

use ferrolm_gguf::{Array, GgufFile, GgufWriter, TensorType, Value};

fn every_value_type() -> Vec<(&'static str, Value)> {
    vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-100)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("f32", Value::F32(-1.5e-7)),
        ("bool", Value::Bool(true)),
        ("string", Value::String("héllo, 世界".into())),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f64", Value::F64(std::f64::consts::PI)),
        ("arr.u8", Value::Array(Array::U8(vec![1, 2, 3]))),
        ("arr.i8", Value::Array(Array::I8(vec![-1, 2]))),
        ("arr.u16", Value::Array(Array::U16(vec![1, 65535]))),
        ("arr.i16", Value::Array(Array::I16(vec![-1]))),
        ("arr.u32", Value::Array(Array::U32(vec![7; 100]))),
        ("arr.i32", Value::Array(Array::I32(vec![-7, 7]))),
        ("arr.f32", Value::Array(Array::F32(vec![0.5, -0.25]))),
        ("arr.bool", Value::Array(Array::Bool(vec![true, false]))),
        (
            "arr.str",
            Value::Array(Array::String(vec!["".into(), "x y".into()])),
        ),
        ("arr.u64", Value::Array(Array::U64(vec![u64::MAX]))),
        ("arr.i64", Value::Array(Array::I64(vec![]))),
        ("arr.f64", Value::Array(Array::F64(vec![1e300]))),
        (
            "arr.nested",
            Value::Array(Array::Array(vec![
                Array::Array(vec![Array::String(vec!["deep".into()])]),
                Array::Array(vec![]),
            ])),
        ),
    ]
}

fn sample_writer(alignment: Option<u32>) -> GgufWriter {
    let mut w = GgufWriter::new();
    if let Some(a) = alignment {
        w.set("general.alignment", Value::U32(a));
    }
    for (k, v) in every_value_type() {
        w.set(k, v);
    }
    let types = [
        TensorType::F32,
        TensorType::F16,
        TensorType::Q4_K,
        TensorType::Q8_0,
        TensorType::MXFP4,
    ];
    for (i, ty) in types.into_iter().enumerate() {
        let dims = [ty.block_size() as u64 * 2, 3];
        let n = ty.bytes_for(dims[0] * dims[1]).unwrap() as usize;
        let data: Vec<u8> = (0..n).map(|j| (j * 31 + i) as u8).collect();
        w.add_tensor(format!("t{i}"), &dims, ty, data).unwrap();
    }
    w
}

#[test]
fn written_files_read_back_identical() {
    for alignment in [None, Some(64), Some(1)] {
        let w = sample_writer(alignment);
        let bytes = w.to_bytes();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), alignment.map_or(32, u64::from));
        assert_eq!(f.metadata(), w.metadata());
        for t in f.tensors() {
            assert_eq!(t.offset % f.alignment(), 0);
        }
        // Rewriting what was read gives the same bytes.
        let mut again = GgufWriter::new();
        for (k, v) in f.metadata().iter() {
            again.set(k, v.clone());
        }
        for t in f.tensors() {
            again
                .add_tensor(t.name.clone(), &t.dims, t.ty, f.tensor_data(t).to_vec())
                .unwrap();
        }
        assert_eq!(again.to_bytes(), bytes);
    }
}

#[test]
fn writer_refuses_wrong_sizes_and_duplicates() {
    let mut w = GgufWriter::new();
    assert!(w
        .add_tensor("a", &[32], TensorType::Q4_0, vec![0; 17])
        .is_err());
    assert!(w
        .add_tensor("a", &[31], TensorType::Q4_0, vec![0; 18])
        .is_err());
    w.add_tensor("a", &[32], TensorType::Q4_0, vec![0; 18])
        .unwrap();
    assert!(w
        .add_tensor("a", &[32], TensorType::Q4_0, vec![0; 18])
        .is_err());
}

#[test]
fn files_on_disk_are_mapped() {
    let dir = std::env::temp_dir().join(format!("ferrolm-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.gguf");
    sample_writer(None).write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors().len(), 5);
    assert_eq!(f.metadata().get_str("string").unwrap(), "héllo, 世界");
    let missing = GgufFile::open(dir.join("absent.gguf"))
        .unwrap_err()
        .to_string();
    assert!(missing.contains("absent.gguf"), "{missing}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A header written alone, with each tensor's data placed at its offset afterwards, is the
/// same file [`GgufWriter::to_bytes`] writes.
#[test]
fn header_then_data_at_offsets_is_the_same_file() {
    use ferrolm_gguf::TensorLayout;
    let tensors = [
        ("a", vec![32u64, 3], TensorType::Q8_0),
        ("b", vec![5u64], TensorType::F32),
        ("c", vec![64u64, 2], TensorType::Q4_0),
    ];
    let mut whole = GgufWriter::new();
    let mut header_only = GgufWriter::new();
    for w in [&mut whole, &mut header_only] {
        w.set("general.architecture", Value::String("llama".into()));
        w.set("x.count", Value::U32(7));
    }
    let mut layouts = Vec::new();
    let mut datas = Vec::new();
    for (i, (name, dims, ty)) in tensors.iter().enumerate() {
        let n: u64 = dims.iter().product();
        let bytes = ty.bytes_for(n).unwrap() as usize;
        let data: Vec<u8> = (0..bytes).map(|j| (i * 31 + j) as u8).collect();
        whole.add_tensor(*name, dims, *ty, data.clone()).unwrap();
        layouts.push(TensorLayout {
            name: name.to_string(),
            dims: dims.clone(),
            ty: *ty,
        });
        datas.push(data);
    }
    let expected = whole.to_bytes();
    let h = header_only.header(&layouts).unwrap();
    assert_eq!(h.file_len as usize, expected.len());
    let mut file = vec![0u8; h.file_len as usize];
    file[..h.bytes.len()].copy_from_slice(&h.bytes);
    for (off, data) in h.offsets.iter().zip(&datas) {
        file[*off as usize..*off as usize + data.len()].copy_from_slice(data);
    }
    assert_eq!(file, expected);
    // A duplicate name is refused.
    layouts.push(layouts[0].clone());
    assert!(header_only.header(&layouts).is_err());
}
