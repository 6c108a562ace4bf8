//! Split models (llama.cpp's gguf-split layout): written by `write_split`, opened from the
//! first shard as one model, and every way a set of shards can be wrong refused by name.

use std::path::{Path, PathBuf};

use ferrolm_gguf::{
    write_split, GgufError, GgufFile, GgufWriter, TensorType, Value, SPLIT_COUNT_KEY, SPLIT_NO_KEY,
    SPLIT_TENSORS_COUNT_KEY,
};

/// A model of five tensors of different sizes and types.
fn model() -> GgufFile {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.set("llama.block_count", Value::U32(2));
    for (i, (ty, n)) in [
        (TensorType::F32, 7u64),
        (TensorType::Q8_0, 64),
        (TensorType::F16, 3),
        (TensorType::Q4_0, 96),
        (TensorType::F32, 1000),
    ]
    .into_iter()
    .enumerate()
    {
        let size = ty.bytes_for(n).unwrap() as usize;
        let data = (0..size).map(|b| (b * 7 + i * 31) as u8).collect();
        w.add_tensor(format!("t{i}"), &[n], ty, data).unwrap();
    }
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrolm-split-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every tensor of `split` has the name, shape, type and bytes of the same tensor of `whole`.
fn assert_same_model(whole: &GgufFile, split: &GgufFile) {
    assert_eq!(whole.tensors().len(), split.tensors().len());
    for (a, b) in whole.tensors().iter().zip(split.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(whole.tensor_data(a), split.tensor_data(b), "{}", a.name);
    }
    assert_eq!(
        whole.metadata().get_str("general.architecture").unwrap(),
        split.metadata().get_str("general.architecture").unwrap()
    );
}

fn write(dir: &Path, per_shard: usize) -> Vec<PathBuf> {
    write_split(&model(), &dir.join("m"), per_shard).unwrap()
}

#[test]
fn shards_on_disk_open_as_the_model_from_the_first() {
    let dir = temp_dir("disk");
    let paths = write(&dir, 2);
    let names: Vec<_> = paths.iter().map(|p| p.file_name().unwrap()).collect();
    assert_eq!(
        names,
        [
            "m-00001-of-00003.gguf",
            "m-00002-of-00003.gguf",
            "m-00003-of-00003.gguf"
        ]
    );
    let f = GgufFile::open(&paths[0]).unwrap();
    assert_same_model(&model(), &f);
    let shards = f.shards();
    assert_eq!(shards.len(), 3);
    assert_eq!(
        shards.iter().map(|s| s.n_tensors).collect::<Vec<_>>(),
        [2, 2, 1]
    );
    assert_eq!(shards[2].path.as_deref(), Some(paths[2].as_path()));
    // Positioned reads (the streamed experts' path) find each tensor in its shard.
    for t in f.tensors() {
        let mut buf = vec![0u8; t.size as usize];
        f.read_exact_at(f.data_offset() + t.offset, &mut buf)
            .unwrap();
        assert_eq!(buf, f.tensor_data(t), "{}", t.name);
    }
    // A read may not run from one shard into the gap after it.
    let last_of_first = &f.tensors()[1];
    let mut past = vec![0u8; last_of_first.size as usize + 4096];
    let end_of_shard = f.data_offset() + last_of_first.offset;
    assert!(f.read_exact_at(end_of_shard, &mut past).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shards_in_memory_equal_the_whole_model() {
    let dir = temp_dir("memory");
    let paths = write(&dir, 1);
    let bytes: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let slices: Vec<&[u8]> = bytes.iter().map(|b| b.as_slice()).collect();
    let f = GgufFile::from_shards(&slices).unwrap();
    assert_same_model(&model(), &f);
    assert_eq!(f.shards().len(), 5);
    // Only the first shard carries the model's metadata; all carry the split keys.
    let second = GgufFile::from_bytes(bytes[1].clone()).unwrap();
    assert!(second.metadata().get("general.architecture").is_none());
    assert_eq!(second.metadata().get_u32(SPLIT_NO_KEY).unwrap(), 1);
    assert_eq!(second.metadata().get_u32(SPLIT_COUNT_KEY).unwrap(), 5);
    assert_eq!(
        second.metadata().get_u32(SPLIT_TENSORS_COUNT_KEY).unwrap(),
        5
    );
    // Too few shards given.
    assert!(GgufFile::from_shards(&slices[..4]).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_later_shard_opened_alone_names_the_first() {
    let dir = temp_dir("later");
    let paths = write(&dir, 2);
    let err = GgufFile::open(&paths[1]).unwrap_err();
    assert!(matches!(
        err,
        GgufError::NotFirstShard {
            no: 2,
            count: 3,
            ..
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains("m-00001-of-00003.gguf"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_shard_is_named() {
    let dir = temp_dir("missing");
    let paths = write(&dir, 2);
    std::fs::remove_file(&paths[2]).unwrap();
    let err = GgufFile::open(&paths[0]).unwrap_err();
    assert!(
        matches!(&err, GgufError::MissingShard { index: 3, count: 3, path, .. } if *path == paths[2]),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_shard_of_another_model_is_refused() {
    let dir = temp_dir("foreign");
    let ours = write(&dir, 2);
    // Shard 2 of a model split in three of another tensor count.
    let other_dir = dir.join("other");
    std::fs::create_dir_all(&other_dir).unwrap();
    let mut w = GgufWriter::new();
    for i in 0..6 {
        w.add_tensor(format!("u{i}"), &[4], TensorType::F32, vec![0; 16])
            .unwrap();
    }
    let other = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let theirs = write_split(&other, &other_dir.join("m"), 2).unwrap();
    std::fs::copy(&theirs[1], &ours[1]).unwrap();
    let err = GgufFile::open(&ours[0]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, GgufError::ForeignShard { .. }), "{msg}");
    assert!(
        msg.contains("m-00002-of-00003.gguf") && msg.contains(SPLIT_TENSORS_COUNT_KEY),
        "{msg}"
    );
    // Shards swapped: split.no does not match the position.
    let ours = write(&dir, 2);
    let second = std::fs::read(&ours[1]).unwrap();
    std::fs::copy(&ours[2], &ours[1]).unwrap();
    std::fs::write(&ours[2], second).unwrap();
    let msg = GgufFile::open(&ours[0]).unwrap_err().to_string();
    assert!(msg.contains(SPLIT_NO_KEY), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A shard set whose keys are consistent but whose tensors are not what they declare.
#[test]
fn tensor_counts_and_duplicates_across_shards_are_checked() {
    let shard = |no: u16, count: u16, total: i32, names: &[&str]| {
        let mut w = GgufWriter::new();
        w.set(SPLIT_NO_KEY, Value::U16(no));
        w.set(SPLIT_COUNT_KEY, Value::U16(count));
        w.set(SPLIT_TENSORS_COUNT_KEY, Value::I32(total));
        for n in names {
            w.add_tensor(*n, &[8], TensorType::F32, vec![1; 32])
                .unwrap();
        }
        w.to_bytes()
    };
    let (a, b) = (shard(0, 2, 3, &["x", "y"]), shard(1, 2, 3, &["z"]));
    assert_eq!(GgufFile::from_shards(&[&a, &b]).unwrap().tensors().len(), 3);
    let (a, b) = (shard(0, 2, 4, &["x", "y"]), shard(1, 2, 4, &["z"]));
    let err = GgufFile::from_shards(&[&a, &b]).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::ShardTensorCount {
                expected: 4,
                found: 3,
                shards: 2
            }
        ),
        "{err}"
    );
    let (a, b) = (shard(0, 2, 3, &["x", "y"]), shard(1, 2, 3, &["x"]));
    let err = GgufFile::from_shards(&[&a, &b]).unwrap_err();
    assert!(
        matches!(err, GgufError::DuplicateTensor(ref n) if n == "x"),
        "{err}"
    );
}

#[test]
fn a_first_shard_with_another_name_cannot_find_the_rest() {
    let dir = temp_dir("name");
    let paths = write(&dir, 2);
    let renamed = dir.join("model.gguf");
    std::fs::rename(&paths[0], &renamed).unwrap();
    let err = GgufFile::open(&renamed).unwrap_err();
    assert!(matches!(err, GgufError::ShardName { .. }), "{err}");
    assert!(err.to_string().contains("-00001-of-00003.gguf"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// gguf-split's `--no-tensor-first-split`: the first shard holds the metadata alone.
#[test]
fn a_first_shard_without_tensors_opens() {
    let dir = temp_dir("no-tensor-first");
    let whole = model();
    let mut first = GgufWriter::new();
    for (k, v) in whole.metadata().iter() {
        first.set(k, v.clone());
    }
    let keys = |w: &mut GgufWriter, no: u16| {
        w.set(SPLIT_NO_KEY, Value::U16(no));
        w.set(SPLIT_COUNT_KEY, Value::U16(2));
        w.set(
            SPLIT_TENSORS_COUNT_KEY,
            Value::I32(whole.tensors().len() as i32),
        );
    };
    keys(&mut first, 0);
    let mut second = GgufWriter::new();
    keys(&mut second, 1);
    for t in whole.tensors() {
        second
            .add_tensor(t.name.clone(), &t.dims, t.ty, whole.tensor_data(t).to_vec())
            .unwrap();
    }
    first.write_file(dir.join("m-00001-of-00002.gguf")).unwrap();
    second
        .write_file(dir.join("m-00002-of-00002.gguf"))
        .unwrap();
    let f = GgufFile::open(dir.join("m-00001-of-00002.gguf")).unwrap();
    assert_same_model(&whole, &f);
    assert_eq!(
        f.shards().iter().map(|s| s.n_tensors).collect::<Vec<_>>(),
        [0, 5]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
