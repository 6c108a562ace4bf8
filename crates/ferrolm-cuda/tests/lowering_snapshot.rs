//! The lowered decode steps of every kind of file the CUDA tests use, fingerprinted: launches
//! (kernels, grids, blocks, shared memory, arguments), matrices (type, shape, views, kernel,
//! and the bytes uploaded), vectors (the values uploaded) and every size of the plan. A change
//! to any lowered plan changes its fingerprint; when the change is meant, the failure prints
//! the new table to paste below. `FERROLM_SNAPSHOT_DIR=dir` writes each plan's full text there
//! (to see what changed with `diff`).

use std::fmt::Write as _;
use std::sync::Arc;

use ferrolm_cuda::schedule::{decode_plan_with, tensor_parallel_plans, DecodePlan};
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
    ("qwen3moe / default / 8", 0xcd56f33269e0855d),
    ("qwen3moe / default / 300", 0x1b7b710cb60a0e09),
    ("qwen3moe / quantize apart / 8", 0x79060f451cdb26e1),
    ("qwen3moe / quantize apart / 300", 0xdbe3cd9bb1563d1d),
    ("qwen3moe / f32 / 8", 0x47636720069119fd),
    ("qwen3moe / f32 / 300", 0xf65e9eff0c093619),
    ("qwen3moe / plain rows / 8", 0xe87a6834fa04e9ca),
    ("qwen3moe / plain rows / 300", 0xa867df0d2616c4ae),
    ("qwen2moe / default / 8", 0x3233f3fa8d01cc14),
    ("qwen2moe / default / 300", 0xf48c5a35c4344a7c),
    ("qwen2moe / quantize apart / 8", 0x4092479d343a8ce6),
    ("qwen2moe / quantize apart / 300", 0x871da9067a0fb2ae),
    ("qwen2moe / f32 / 8", 0xf6755a33c9ab64d6),
    ("qwen2moe / f32 / 300", 0xf5250bc53d2b1ea6),
    ("qwen2moe / plain rows / 8", 0x74d0bf4f2e3a9aa9),
    ("qwen2moe / plain rows / 300", 0xba56ade2fc2d9769),
    ("llama experts / default / 8", 0x2efa07da6cc57f9c),
    ("llama experts / default / 300", 0xb12cfd8f386b66c0),
    ("llama experts / quantize apart / 8", 0xe99692d76ce9c560),
    ("llama experts / quantize apart / 300", 0x47f9cfb91004698c),
    ("llama experts / f32 / 8", 0xc48b6293c7e3e858),
    ("llama experts / f32 / 300", 0xd72cd32e1c1914c4),
    ("llama experts / plain rows / 8", 0x72eb8593bf83ebb3),
    ("llama experts / plain rows / 300", 0x84872cfafe222787),
    ("qwen3next / default / 8", 0xa669f1ec3d0e9c58),
    ("qwen3next / default / 300", 0xebffc9fe48f741dc),
    ("qwen3next / quantize apart / 8", 0x99a20140afea4779),
    ("qwen3next / quantize apart / 300", 0x0f02a468bda91ec5),
    ("qwen3next / f32 / 8", 0x6ff281c5a9433266),
    ("qwen3next / f32 / 300", 0x098b44f77ff88a0e),
    ("qwen3next / plain rows / 8", 0x4db7c0e92c336496),
    ("qwen3next / plain rows / 300", 0x4ab3bccbe63da2be),
    ("qwen35 / default / 8", 0xdbc2aee953d19184),
    ("qwen35 / default / 300", 0x693276c3f7642834),
    ("qwen35 / quantize apart / 8", 0x896641168fc5e523),
    ("qwen35 / quantize apart / 300", 0xcae2558350c36b67),
    ("qwen35 / f32 / 8", 0x4ac584a458c88e39),
    ("qwen35 / f32 / 300", 0x96208a0700772f65),
    ("qwen35 / plain rows / 8", 0xd91b28c222fa6605),
    ("qwen35 / plain rows / 300", 0x9af9d720d2d281f5),
    ("qwen35moe / default / 8", 0x9831b8ba90b59456),
    ("qwen35moe / default / 300", 0x7ece6cb09cabc358),
    ("qwen35moe / quantize apart / 8", 0xb6374e61e606bd5b),
    ("qwen35moe / quantize apart / 300", 0xfcbcf904b5a01215),
    ("qwen35moe / f32 / 8", 0xdc89420c062d1367),
    ("qwen35moe / f32 / 300", 0x61b305cd0c681149),
    ("qwen35moe / plain rows / 8", 0x952e2df346bbd88f),
    ("qwen35moe / plain rows / 300", 0x091b144526c8a879),
    ("qwen3next split / default / 8", 0xca2c1c00f8f0da8d),
    ("qwen3next split / default / 300", 0x0f008764a9f821f7),
    ("qwen3next split / quantize apart / 8", 0xd405759204d3a9de),
    ("qwen3next split / quantize apart / 300", 0x99d15b7df06be058),
    ("qwen3next split / f32 / 8", 0x665bb5b4afbfa797),
    ("qwen3next split / f32 / 300", 0x0493d31a60f82b35),
    ("qwen3next split / plain rows / 8", 0x08b81ee76910434b),
    ("qwen3next split / plain rows / 300", 0xaeda2e2fdbfa6481),
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
    ("dots1 / default / 8", 0xe7734ddee18cd416),
    ("dots1 / default / 300", 0xd6a44f987d6bdd7a),
    ("dots1 / quantize apart / 8", 0x505b4e2c13bcd956),
    ("dots1 / quantize apart / 300", 0x72f836df299b037a),
    ("dots1 / f32 / 8", 0x4c1cd5a87d9342e5),
    ("dots1 / f32 / 300", 0x814290b0b1ab162d),
    ("dots1 / plain rows / 8", 0x167137662436c83d),
    ("dots1 / plain rows / 300", 0x7c9a08eeee3d4579),
    ("gpt-oss / default / 8", 0xf3c3f01df037aec3),
    ("gpt-oss / default / 300", 0xbdb537674d72a80e),
    ("gpt-oss / quantize apart / 8", 0xa71441ecd6053c15),
    ("gpt-oss / quantize apart / 300", 0xf3035b1e77cf28ec),
    ("gpt-oss / f32 / 8", 0x64de9cf748ed1c8b),
    ("gpt-oss / f32 / 300", 0x5273ead306b4f1de),
    ("gpt-oss / plain rows / 8", 0x9b10f72f2869cb2e),
    ("gpt-oss / plain rows / 300", 0x1ef24f2f93bd808d),
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
