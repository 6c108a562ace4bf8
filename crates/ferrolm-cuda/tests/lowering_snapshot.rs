//! The lowered decode steps of every kind of file the CUDA tests use, fingerprinted: launches
//! (kernels, grids, blocks, shared memory, arguments), matrices (type, shape, views, kernel,
//! and the bytes uploaded), vectors (the values uploaded) and every size of the plan. A change
//! to any lowered plan changes its fingerprint; when the change is meant, the failure prints
//! the new table to paste below. `FERROLM_SNAPSHOT_DIR=dir` writes each plan's full text there
//! (to see what changed with `diff`).

mod kernel_source;

use std::fmt::Write as _;
use std::sync::Arc;

use ferrolm_cuda::schedule::{decode_plan_with, tensor_parallel_plans, Arg, DecodePlan};
use ferrolm_cuda::CudaTuning;
use ferrolm_gguf::{GgufFile, TensorType};
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::Model;

/// FNV-1a, 64 bits: a fingerprint that is the same on every machine and toolchain.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The bytes the device would upload for matrix `i`.
fn matrix_bytes(file: &GgufFile, p: &DecodePlan, i: usize) -> Vec<u8> {
    let m = &p.matrices[i];
    m.bytes(file.file_bytes()).expect("its rows").into_owned()
}

/// The values the device would upload for vector `i`.
fn vector_values(_: &GgufFile, p: &DecodePlan, i: usize) -> Vec<f32> {
    p.vectors[i].values.to_vec()
}

/// Everything a plan says but its labels, as text.
fn dump(file: &GgufFile, p: &DecodePlan) -> String {
    let DecodePlan {
        layers,
        embd,
        head,
        norm_eps,
        matrices,
        vectors,
        launches,
        n_embd,
        n_vocab,
        vocab_first,
        n_ctx,
        splits,
        max_q,
        max_attn,
        delta,
        max_kv,
        max_ff,
        max_part,
        max_heads_splits,
        kv_dims,
        max_experts,
        max_used,
        embedding_scale,
        logits,
        cpu_experts,
        staged_experts,
    } = p;
    let mut s = String::new();
    writeln!(
        s,
        "embd {embd} head {head:?} eps {norm_eps:?} n_embd {n_embd} n_vocab {n_vocab} \
         vocab_first {vocab_first} n_ctx {n_ctx} splits {splits} max_q {max_q} max_attn \
         {max_attn} delta {delta:?} max_kv {max_kv} max_ff {max_ff} max_part {max_part} \
         max_heads_splits {max_heads_splits} kv_dims {kv_dims:?} max_experts {max_experts} \
         max_used {max_used} embedding_scale {embedding_scale:?} logits {logits:?}"
    )
    .unwrap();
    if let Some(c) = cpu_experts {
        writeln!(s, "cpu_experts {c:?}").unwrap();
    }
    if let Some(c) = staged_experts {
        writeln!(s, "staged_experts {c:?}").unwrap();
    }
    for (i, l) in layers.iter().enumerate() {
        writeln!(s, "layer {i}: {l:?}").unwrap();
    }
    for (i, m) in matrices.iter().enumerate() {
        writeln!(
            s,
            "matrix {i}: {:?} {}x{} first_row {} first_col {} tensor_cols {} experts {} \
             kernel {} bytes {:016x}",
            m.ty,
            m.rows,
            m.cols,
            m.first_row,
            m.first_col,
            m.tensor_cols,
            m.experts,
            m.kernel,
            fnv(&matrix_bytes(file, p, i))
        )
        .unwrap();
    }
    for i in 0..vectors.len() {
        let v = vector_values(file, p, i);
        let bits: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        writeln!(s, "vector {i}: len {} values {:016x}", v.len(), fnv(&bits)).unwrap();
    }
    for l in launches {
        writeln!(
            s,
            "{} grid {:?} block {} shared {} {:?}",
            l.kernel, l.grid, l.block, l.shared, l.args
        )
        .unwrap();
    }
    s
}

fn small(arch: &str) -> SyntheticSpec {
    let mut s = SyntheticSpec::small(arch);
    s.n_layer = 2;
    s.head_dim = 64;
    s
}

/// The files of emulated_step.rs and emulated_batches.rs.
fn files() -> Vec<(&'static str, SyntheticSpec)> {
    let mut cases = Vec::new();
    for arch in ["llama", "qwen2", "qwen3"] {
        cases.push((arch, small(arch)));
    }
    for arch in ["gemma2", "gemma3", "granite", "phi3"] {
        let mut s = SyntheticSpec::small(arch);
        s.head_dim = 64;
        s.sliding_window = s.sliding_window.map(|_| 8);
        cases.push((arch, s));
    }
    let mut long_rope = SyntheticSpec::small("phi3");
    long_rope.head_dim = 64;
    long_rope.long_rope = Some(16);
    cases.push(("phi3 LongRoPE", long_rope));
    for arch in ["qwen3moe", "qwen2moe", "llama"] {
        let mut s = SyntheticSpec::small(arch);
        s.head_dim = 64;
        if arch == "llama" {
            s.n_expert = 8;
            s.n_expert_used = 2;
            s.n_ff = 256;
        }
        cases.push((
            if arch == "llama" {
                "llama experts"
            } else {
                arch
            },
            s,
        ));
    }
    for arch in ["qwen3next", "qwen35", "qwen35moe"] {
        cases.push((arch, SyntheticSpec::small(arch)));
    }
    let mut split = SyntheticSpec::small("qwen3next");
    if let Some(net) = split.delta_net.as_mut() {
        net.split_projections = true;
    }
    cases.push(("qwen3next split", split));
    let mut yarn = small("llama");
    yarn.yarn = Some((4.0, 512));
    cases.push(("llama YaRN", yarn));
    let mut freqs = SyntheticSpec::small("llama");
    freqs.n_layer = 2;
    freqs.rope_freqs = true;
    freqs.tied_output = true;
    freqs.default_type = TensorType::Q4_K;
    cases.push(("llama Q4_K, frequency factors, tied", freqs));
    let mut uniform = SyntheticSpec::small("llama");
    uniform.n_layer = 2;
    uniform.default_type = TensorType::Q4_0;
    uniform.types = Vec::new();
    cases.push(("llama Q4_0", uniform));
    let mut mixed = SyntheticSpec::small("llama");
    mixed.n_layer = 2;
    mixed.default_type = TensorType::Q4_0;
    mixed.types = vec![
        ("attn_k".into(), TensorType::Q4_K),
        ("ffn_up".into(), TensorType::Q8_0),
    ];
    cases.push(("llama mixed types", mixed));
    let mut dots1 = SyntheticSpec::small("dots1");
    dots1.head_dim = 64;
    cases.push(("dots1", dots1));
    let mut gpt_oss = SyntheticSpec::small("gpt-oss");
    gpt_oss.sliding_window = Some(8);
    cases.push(("gpt-oss", gpt_oss));
    let mut four = SyntheticSpec::small("llama");
    four.n_layer = 4;
    cases.push(("llama 4 layers", four));
    cases
}

/// The tunings that change a lowering: the defaults, inputs quantized by launches of their
/// own, f32 activations, neither staged nor repacked rows.
fn tunings() -> Vec<(&'static str, CudaTuning)> {
    vec![
        ("default", CudaTuning::default()),
        (
            "quantize apart",
            CudaTuning {
                quantize_on_load_max: 0,
                ..CudaTuning::default()
            },
        ),
        (
            "f32",
            CudaTuning {
                quantized_activations: false,
                ..CudaTuning::default()
            },
        ),
        (
            "plain rows",
            CudaTuning {
                stage: false,
                repack: false,
                ..CudaTuning::default()
            },
        ),
    ]
}

/// Each case's name and the text of its plans.
fn plans() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (name, spec) in files() {
        let file =
            Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
        let model = Model::from_file(file.clone(), 1).unwrap();
        let n_layer = model.plan().layers.len();
        for (t, tuning) in tunings() {
            for n_ctx in [8, 300] {
                let p = decode_plan_with(model.plan(), model.weights(), n_ctx, n_layer, &tuning)
                    .unwrap();
                out.push((format!("{name} / {t} / {n_ctx}"), dump(&file, &p)));
            }
        }
        if name == "llama 4 layers" {
            // --gpu-layers
            for layers in [1, 2] {
                let tuning = CudaTuning::default();
                let p =
                    decode_plan_with(model.plan(), model.weights(), 64, layers, &tuning).unwrap();
                out.push((format!("{name} / first {layers}"), dump(&file, &p)));
            }
        }
    }
    // Tensor-parallel ranks (the llama family's dense layers), a tied output among them.
    for tied in [false, true] {
        let mut spec = small("llama");
        spec.n_head = 4;
        spec.n_head_kv = 4;
        spec.sliding_window = None;
        spec.tied_output = tied;
        let file =
            Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
        let model = Model::from_file(file.clone(), 1).unwrap();
        for ranks in [2, 4] {
            let plans = tensor_parallel_plans(
                model.plan(),
                model.weights(),
                64,
                ranks,
                &CudaTuning::default(),
            )
            .unwrap();
            for (r, p) in plans.iter().enumerate() {
                let name = format!("llama tied {tied} / rank {r} of {ranks}");
                out.push((name, dump(&file, p)));
            }
        }
    }
    out
}

/// The fingerprints of [`plans`], as recorded.
const EXPECTED: &[(&str, u64)] = &[
    ("llama / default / 8", 0xdaf944621d3d4327),
    ("llama / default / 300", 0x1c6c5d95f5e8bdd7),
    ("llama / quantize apart / 8", 0x81a229293b126253),
    ("llama / quantize apart / 300", 0x9924f42f7bd3b54f),
    ("llama / f32 / 8", 0x3d6514bfb573909f),
    ("llama / f32 / 300", 0x0647e3ae7b2cc6ef),
    ("llama / plain rows / 8", 0x462d98b2c9ef7354),
    ("llama / plain rows / 300", 0x11b9d949c8b1b47c),
    ("qwen2 / default / 8", 0xb5b317390e1d0a57),
    ("qwen2 / default / 300", 0x0e8a657ee95dba5b),
    ("qwen2 / quantize apart / 8", 0x9768e752e1b06283),
    ("qwen2 / quantize apart / 300", 0xee238e7d5dd49833),
    ("qwen2 / f32 / 8", 0x92584e6f46fe90df),
    ("qwen2 / f32 / 300", 0xa4eb0a435096990b),
    ("qwen2 / plain rows / 8", 0x002edb3a6e883ad4),
    ("qwen2 / plain rows / 300", 0xc6a77d25bc030bd0),
    ("qwen3 / default / 8", 0x8a862673ae8894ec),
    ("qwen3 / default / 300", 0xd05c755195828fd8),
    ("qwen3 / quantize apart / 8", 0x9bd984db23679b6c),
    ("qwen3 / quantize apart / 300", 0xdf473baf387b3ef4),
    ("qwen3 / f32 / 8", 0xc3e897e7cd38e896),
    ("qwen3 / f32 / 300", 0xa68ef9a61f7fe3c2),
    ("qwen3 / plain rows / 8", 0x4ad0fdbee4ca7035),
    ("qwen3 / plain rows / 300", 0x51c18c2a989651e1),
    ("gemma2 / default / 8", 0x67a4cbb354f3c0c1),
    ("gemma2 / default / 300", 0xf518e4f95527c3f5),
    ("gemma2 / quantize apart / 8", 0xdf70a5a5949a532d),
    ("gemma2 / quantize apart / 300", 0xb4286f10bf1abf0d),
    ("gemma2 / f32 / 8", 0x3c088e5248d3fa93),
    ("gemma2 / f32 / 300", 0xe29993307ec44057),
    ("gemma2 / plain rows / 8", 0xb9a06bbc4634d1a8),
    ("gemma2 / plain rows / 300", 0xbca4f0d40920137c),
    ("gemma3 / default / 8", 0x16b5db893f04761b),
    ("gemma3 / default / 300", 0xc7406ff85e13f30b),
    ("gemma3 / quantize apart / 8", 0x955b9f7848605f6d),
    ("gemma3 / quantize apart / 300", 0x4c37a2e3968f2ad1),
    ("gemma3 / f32 / 8", 0xf5e6837659793ba3),
    ("gemma3 / f32 / 300", 0x7ed853117209cabb),
    ("gemma3 / plain rows / 8", 0xa8e556526087ca72),
    ("gemma3 / plain rows / 300", 0x98d011a9b8ab9daa),
    ("granite / default / 8", 0x907406a9d5dad557),
    ("granite / default / 300", 0x89013818259f84cb),
    ("granite / quantize apart / 8", 0x241381cb6ea09885),
    ("granite / quantize apart / 300", 0x59731f4e12f42401),
    ("granite / f32 / 8", 0x1442ad05b598680d),
    ("granite / f32 / 300", 0xc2c0e3dea462a611),
    ("granite / plain rows / 8", 0xb0bcee58d98092cc),
    ("granite / plain rows / 300", 0xdd01bbd6767ee370),
    ("phi3 / default / 8", 0xc68a1ee17c622275),
    ("phi3 / default / 300", 0x5b7d9909548376d9),
    ("phi3 / quantize apart / 8", 0x4daf3827b2120947),
    ("phi3 / quantize apart / 300", 0x99e72429a461b423),
    ("phi3 / f32 / 8", 0xff04bb6f26120deb),
    ("phi3 / f32 / 300", 0xf936426094f942b7),
    ("phi3 / plain rows / 8", 0xd87d3d0ce1c87752),
    ("phi3 / plain rows / 300", 0x3310bc1786f9028e),
    ("phi3 LongRoPE / default / 8", 0x8c4ec187d8203602),
    ("phi3 LongRoPE / default / 300", 0x57f21a597d17ebaa),
    ("phi3 LongRoPE / quantize apart / 8", 0x383687e04c387258),
    ("phi3 LongRoPE / quantize apart / 300", 0xe22d29126b268fb8),
    ("phi3 LongRoPE / f32 / 8", 0xaaebc995e3fa3784),
    ("phi3 LongRoPE / f32 / 300", 0x607a8122aac8676c),
    ("phi3 LongRoPE / plain rows / 8", 0x7cd4d55291e4080b),
    ("phi3 LongRoPE / plain rows / 300", 0x0a2bb23774cb53e3),
    ("qwen3moe / default / 8", 0xb17a6cd86ee65ba5),
    ("qwen3moe / default / 300", 0x30fe219a33c879d1),
    ("qwen3moe / quantize apart / 8", 0x4784de2b4abe2f61),
    ("qwen3moe / quantize apart / 300", 0xec80f0731d3f173d),
    ("qwen3moe / f32 / 8", 0x596bb65a0fddee81),
    ("qwen3moe / f32 / 300", 0x26bb6eac1ee13add),
    ("qwen3moe / plain rows / 8", 0x01cbc9b3619e579a),
    ("qwen3moe / plain rows / 300", 0xbda8e14bdea66886),
    ("qwen2moe / default / 8", 0x3d19e52c3ea0141e),
    ("qwen2moe / default / 300", 0xfde96cd50259e3fe),
    ("qwen2moe / quantize apart / 8", 0x5f9b78bb70480c68),
    ("qwen2moe / quantize apart / 300", 0x864b06dc8a955fc0),
    ("qwen2moe / f32 / 8", 0x97cb2e2aa35eaf6c),
    ("qwen2moe / f32 / 300", 0xda619a63d6940014),
    ("qwen2moe / plain rows / 8", 0xc1f4a4b290fe151f),
    ("qwen2moe / plain rows / 300", 0x141936392e9c29e7),
    ("llama experts / default / 8", 0x59679582e888218c),
    ("llama experts / default / 300", 0x4e0757b7421bdaf8),
    ("llama experts / quantize apart / 8", 0xa64836dd2838c8b8),
    ("llama experts / quantize apart / 300", 0x7e56f8022b2f423c),
    ("llama experts / f32 / 8", 0x42aa0d391b2879c8),
    ("llama experts / f32 / 300", 0x4e39f0b3df821c74),
    ("llama experts / plain rows / 8", 0x0148e455a6bad3e3),
    ("llama experts / plain rows / 300", 0x6128b216fd7a0f6f),
    ("qwen3next / default / 8", 0x816aed24062d13ee),
    ("qwen3next / default / 300", 0x6b79146222014fd6),
    ("qwen3next / quantize apart / 8", 0xfddac29c456969bb),
    ("qwen3next / quantize apart / 300", 0xe8292c88dc0af553),
    ("qwen3next / f32 / 8", 0x480a7cc14bc5c12c),
    ("qwen3next / f32 / 300", 0xcd86fad57fd74ee8),
    ("qwen3next / plain rows / 8", 0xee39b3098ffd3c24),
    ("qwen3next / plain rows / 300", 0xb8de1c5353284240),
    ("qwen35 / default / 8", 0x3d5d0c9f7df5e7a0),
    ("qwen35 / default / 300", 0x968da71cd643f428),
    ("qwen35 / quantize apart / 8", 0x43a7fd27635dec8f),
    ("qwen35 / quantize apart / 300", 0xc71107b3a79b04ab),
    ("qwen35 / f32 / 8", 0x3cc727bf5460f6f5),
    ("qwen35 / f32 / 300", 0xd0585696ef4edd19),
    ("qwen35 / plain rows / 8", 0x94fb49116c0ad109),
    ("qwen35 / plain rows / 300", 0x8c67acf2d20a6681),
    ("qwen35moe / default / 8", 0x32d0b5c1202a89c0),
    ("qwen35moe / default / 300", 0x49c180cb3fc0f66e),
    ("qwen35moe / quantize apart / 8", 0xb82d8037d8efbfa9),
    ("qwen35moe / quantize apart / 300", 0x9e3279c1793a48a7),
    ("qwen35moe / f32 / 8", 0x8a7566871806d41f),
    ("qwen35moe / f32 / 300", 0x3728c52611821275),
    ("qwen35moe / plain rows / 8", 0x154f29b65357b055),
    ("qwen35moe / plain rows / 300", 0x2185b05f5394841b),
    ("qwen3next split / default / 8", 0x05bdb9d853806c97),
    ("qwen3next split / default / 300", 0x6e94ed7d4cfb61ed),
    ("qwen3next split / quantize apart / 8", 0x82b5729420b0fabc),
    ("qwen3next split / quantize apart / 300", 0x01d32447a71b66d2),
    ("qwen3next split / f32 / 8", 0xa7571845e886d10d),
    ("qwen3next split / f32 / 300", 0xd649f58882b98cc7),
    ("qwen3next split / plain rows / 8", 0xa6ffc3ab152eab65),
    ("qwen3next split / plain rows / 300", 0x7df91c3802f72467),
    ("llama YaRN / default / 8", 0xf8c9e89ded91bc59),
    ("llama YaRN / default / 300", 0xcba774570b202395),
    ("llama YaRN / quantize apart / 8", 0xd0201aa362cf994d),
    ("llama YaRN / quantize apart / 300", 0x3f060388f154a80d),
    ("llama YaRN / f32 / 8", 0x58a652fbd91c26a9),
    ("llama YaRN / f32 / 300", 0x8b5a4cc2641dfeb5),
    ("llama YaRN / plain rows / 8", 0x9cc527d89a0a0ece),
    ("llama YaRN / plain rows / 300", 0x1d5980c6c874e982),
    (
        "llama Q4_K, frequency factors, tied / default / 8",
        0x542d7011e72588e1,
    ),
    (
        "llama Q4_K, frequency factors, tied / default / 300",
        0xb402a19571c31888,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 8",
        0x539d98dbb3b9c477,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 300",
        0xa101c06c840fc19a,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 8",
        0x7ffdd2ab98b80fd7,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 300",
        0xd56c18b70ec942fe,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 8",
        0x712288182824679e,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 300",
        0x034b6e8c2db12b1b,
    ),
    ("llama Q4_0 / default / 8", 0x5a710a9dc538302f),
    ("llama Q4_0 / default / 300", 0xd786487836011e72),
    ("llama Q4_0 / quantize apart / 8", 0x597813b79def7b2d),
    ("llama Q4_0 / quantize apart / 300", 0xdb31406d00a2ed9c),
    ("llama Q4_0 / f32 / 8", 0xcade7920975e854a),
    ("llama Q4_0 / f32 / 300", 0x2bf6f5bb8243c881),
    ("llama Q4_0 / plain rows / 8", 0x64852cbf8e848e13),
    ("llama Q4_0 / plain rows / 300", 0x760d6cf06c34d24e),
    ("llama mixed types / default / 8", 0x1764f0f9b9af21d0),
    ("llama mixed types / default / 300", 0x83b4db6ff14582bd),
    ("llama mixed types / quantize apart / 8", 0x9a1581d27a3439d0),
    (
        "llama mixed types / quantize apart / 300",
        0xf7c0d5bb8cca5eed,
    ),
    ("llama mixed types / f32 / 8", 0xdea4a296cdc9b06f),
    ("llama mixed types / f32 / 300", 0x46914e820f26e51c),
    ("llama mixed types / plain rows / 8", 0x89b91a38659020f6),
    ("llama mixed types / plain rows / 300", 0xb949bf5ee48ce93f),
    ("dots1 / default / 8", 0x4fb149d6ebd46eb3),
    ("dots1 / default / 300", 0x6cf3dd08c9cc16cb),
    ("dots1 / quantize apart / 8", 0xa9b3b3bfcd2c418f),
    ("dots1 / quantize apart / 300", 0x797c90ceb4b08857),
    ("dots1 / f32 / 8", 0x834d95840b401828),
    ("dots1 / f32 / 300", 0x03780cd48dee19d4),
    ("dots1 / plain rows / 8", 0xe65cf9907bd1d0d2),
    ("dots1 / plain rows / 300", 0xceed0e223e1bb6d2),
    ("gpt-oss / default / 8", 0x0d341eb16fc536cf),
    ("gpt-oss / default / 300", 0x9167053f9ab97efa),
    ("gpt-oss / quantize apart / 8", 0x911e292f5afb4fe1),
    ("gpt-oss / quantize apart / 300", 0x47063f571381cdc8),
    ("gpt-oss / f32 / 8", 0x8365b64555bb0eaf),
    ("gpt-oss / f32 / 300", 0x74a7b56d02e13a7a),
    ("gpt-oss / plain rows / 8", 0xddf2227b0732cbe2),
    ("gpt-oss / plain rows / 300", 0x88cd7624aa633ba1),
    ("llama 4 layers / default / 8", 0x781ab9ffee0f10b5),
    ("llama 4 layers / default / 300", 0xd9999c6c117cccec),
    ("llama 4 layers / quantize apart / 8", 0x1931d7debf66de23),
    ("llama 4 layers / quantize apart / 300", 0xf08a9472ef6a48f6),
    ("llama 4 layers / f32 / 8", 0xa3ffaff0b3197a8d),
    ("llama 4 layers / f32 / 300", 0xcbd2695623aef4cc),
    ("llama 4 layers / plain rows / 8", 0x2ef80af0b0a16d82),
    ("llama 4 layers / plain rows / 300", 0x94ad43da72635709),
    ("llama 4 layers / first 1", 0x16c2e3adfb5a5814),
    ("llama 4 layers / first 2", 0x759de9e926545908),
    ("llama tied false / rank 0 of 2", 0x5b04762a1960032e),
    ("llama tied false / rank 1 of 2", 0xdfe85685b6573838),
    ("llama tied false / rank 0 of 4", 0xd51afff4300253c8),
    ("llama tied false / rank 1 of 4", 0x07c6ec9d56709d41),
    ("llama tied false / rank 2 of 4", 0x732f96ccc8dff1c1),
    ("llama tied false / rank 3 of 4", 0x93d89ad8e831913c),
    ("llama tied true / rank 0 of 2", 0x85481e937d69d501),
    ("llama tied true / rank 1 of 2", 0x66bbd336cc5aa25c),
    ("llama tied true / rank 0 of 4", 0x6829c7447433c11c),
    ("llama tied true / rank 1 of 4", 0x9d61b381c983223f),
    ("llama tied true / rank 2 of 4", 0xb8114f75ddaada5c),
    ("llama tied true / rank 3 of 4", 0xe540190205c5194e),
];

#[test]
fn lowered_plans_are_as_recorded() {
    let plans = plans();
    if let Some(dir) = std::env::var_os("FERROLM_SNAPSHOT_DIR") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in &plans {
            let file = name.replace([' ', '/', ','], "_");
            std::fs::write(dir.join(file), text).unwrap();
        }
    }
    let found: Vec<(String, u64)> = plans
        .iter()
        .map(|(n, t)| (n.clone(), fnv(t.as_bytes())))
        .collect();
    let expected: Vec<(String, u64)> = EXPECTED.iter().map(|(n, h)| (n.to_string(), *h)).collect();
    if found != expected {
        let mut table = String::new();
        for (n, h) in &found {
            writeln!(table, "    ({n:?}, 0x{h:016x}),").unwrap();
        }
        let differ: Vec<&str> = found
            .iter()
            .filter(|f| !expected.contains(f))
            .map(|f| f.0.as_str())
            .collect();
        panic!(
            "{} of {} lowered plans differ from the recorded ones ({differ:?}); if that is \
             meant, record these:\n{table}",
            differ.len(),
            found.len()
        );
    }
}

fn arg_fits(arg: &Arg, param: &kernel_source::Param) -> bool {
    use kernel_source::Param;
    matches!(
        (arg, param),
        (Arg::Buf(_) | Arg::Null, Param::Pointer)
            | (Arg::I32(_), Param::Int)
            | (Arg::F32(_), Param::Float)
            | (Arg::I64(_), Param::Long)
    )
}

/// Every launch of every lowered plan passes as many arguments as its kernel declares, each
/// of the kind declared (a pointer, an int, a float, a long long): on a GPU a missing or extra
/// argument shifts the others silently.
#[test]
fn every_launch_passes_its_kernels_parameters() {
    let all = kernel_source::kernels();
    let mut checked = std::collections::BTreeSet::new();
    // (and heads of 128 and 256 values, attended by warps; Q and K of one type with V of
    // another, one launch)
    let mut extra = Vec::new();
    for (arch, hd) in [("llama", 128), ("gemma3", 256), ("qwen3moe", 128)] {
        let mut s = SyntheticSpec::small(arch);
        s.head_dim = hd;
        extra.push(("heads", s));
    }
    let mut mixed = SyntheticSpec::small("llama");
    mixed.default_type = TensorType::Q5_0;
    mixed.types = vec![("attn_v".into(), TensorType::Q8_0)];
    extra.push(("mixed", mixed));
    for (_, spec) in files().into_iter().chain(extra) {
        let file =
            Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
        let model = Model::from_file(file, 1).unwrap();
        let n_layer = model.plan().layers.len();
        let unfused = CudaTuning {
            producer_quantize: false,
            fused_moe_combine: false,
            shared_expert_in_grid: false,
            rope_in_attention: false,
            ..CudaTuning::default()
        };
        let unmeasured = CudaTuning {
            shared_expert_in_grid: true,
            delta_runs: true,
            ..CudaTuning::default()
        };
        let more = [("unfused", unfused), ("unmeasured", unmeasured)];
        for (_, tuning) in tunings().into_iter().chain(more) {
            for n_ctx in [8, 300] {
                let p = decode_plan_with(model.plan(), model.weights(), n_ctx, n_layer, &tuning)
                    .unwrap();
                for l in &p.launches {
                    let fits = |params: &Vec<kernel_source::Param>| {
                        params.len() == l.args.len()
                            && l.args.iter().zip(params).all(|(a, p)| arg_fits(a, p))
                    };
                    // (some pasted prefixes have two forms, e.g. matvec3's and the mixed Q/K/V
                    // launch's)
                    let ok = kernel_source::definitions(&all, &l.kernel)
                        .iter()
                        .any(|k| fits(&k.parameters()));
                    assert!(ok, "{}: {:?}", l.kernel, l.args);
                    checked.insert(l.kernel.clone());
                }
            }
        }
    }
    for k in [
        "attn_split_warps",
        "moe_combine_norm_held_q",
        "delta_rule",
        "sigmoid_mul",
    ] {
        assert!(checked.contains(k), "{k} not among {checked:?}");
    }
}

/// Every kernel waits for its predecessor (`step_begin`, itself or in a device function it
/// calls) before it reads the step's buffers, so that any may be launched overlapping the one
/// before it (the decode step's, and the batched passes' with `CudaTuning::batch_overlap`).
#[test]
fn every_kernel_waits_for_its_predecessor() {
    let late = kernel_source::not_waiting();
    assert!(late.is_empty(), "these kernels do not wait: {late:?}");
}
