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
    ("llama / quantize apart / 8", 0xe07219299499878f),
    ("llama / quantize apart / 300", 0x0c7be64528c4d19b),
    ("llama / f32 / 8", 0x3d6514bfb573909f),
    ("llama / f32 / 300", 0x0647e3ae7b2cc6ef),
    ("llama / plain rows / 8", 0x462d98b2c9ef7354),
    ("llama / plain rows / 300", 0x11b9d949c8b1b47c),
    ("qwen2 / default / 8", 0xb5b317390e1d0a57),
    ("qwen2 / default / 300", 0x0e8a657ee95dba5b),
    ("qwen2 / quantize apart / 8", 0x61185352cb73c1bf),
    ("qwen2 / quantize apart / 300", 0x0d89c27a063f10af),
    ("qwen2 / f32 / 8", 0x92584e6f46fe90df),
    ("qwen2 / f32 / 300", 0xa4eb0a435096990b),
    ("qwen2 / plain rows / 8", 0x002edb3a6e883ad4),
    ("qwen2 / plain rows / 300", 0xc6a77d25bc030bd0),
    ("qwen3 / default / 8", 0x8a862673ae8894ec),
    ("qwen3 / default / 300", 0xd05c755195828fd8),
    ("qwen3 / quantize apart / 8", 0xbd30db4b75c50d88),
    ("qwen3 / quantize apart / 300", 0xfa25621539cff0f0),
    ("qwen3 / f32 / 8", 0xc3e897e7cd38e896),
    ("qwen3 / f32 / 300", 0xa68ef9a61f7fe3c2),
    ("qwen3 / plain rows / 8", 0x4ad0fdbee4ca7035),
    ("qwen3 / plain rows / 300", 0x51c18c2a989651e1),
    ("gemma2 / default / 8", 0x67a4cbb354f3c0c1),
    ("gemma2 / default / 300", 0xf518e4f95527c3f5),
    ("gemma2 / quantize apart / 8", 0x403b1266342c6361),
    ("gemma2 / quantize apart / 300", 0x5561cb0a8c6fd521),
    ("gemma2 / f32 / 8", 0x3c088e5248d3fa93),
    ("gemma2 / f32 / 300", 0xe29993307ec44057),
    ("gemma2 / plain rows / 8", 0xb9a06bbc4634d1a8),
    ("gemma2 / plain rows / 300", 0xbca4f0d40920137c),
    ("gemma3 / default / 8", 0x16b5db893f04761b),
    ("gemma3 / default / 300", 0xc7406ff85e13f30b),
    ("gemma3 / quantize apart / 8", 0xb774c43b75043f81),
    ("gemma3 / quantize apart / 300", 0x60fce0b449674335),
    ("gemma3 / f32 / 8", 0xf5e6837659793ba3),
    ("gemma3 / f32 / 300", 0x7ed853117209cabb),
    ("gemma3 / plain rows / 8", 0xa8e556526087ca72),
    ("gemma3 / plain rows / 300", 0x98d011a9b8ab9daa),
    ("granite / default / 8", 0x907406a9d5dad557),
    ("granite / default / 300", 0x89013818259f84cb),
    ("granite / quantize apart / 8", 0xca09f93d78f0f8e5),
    ("granite / quantize apart / 300", 0xb490caef21ae9011),
    ("granite / f32 / 8", 0x1442ad05b598680d),
    ("granite / f32 / 300", 0xc2c0e3dea462a611),
    ("granite / plain rows / 8", 0xb0bcee58d98092cc),
    ("granite / plain rows / 300", 0xdd01bbd6767ee370),
    ("phi3 / default / 8", 0xc68a1ee17c622275),
    ("phi3 / default / 300", 0x5b7d9909548376d9),
    ("phi3 / quantize apart / 8", 0xd0e58c3bce1fd247),
    ("phi3 / quantize apart / 300", 0xccdb498607c2ff53),
    ("phi3 / f32 / 8", 0xff04bb6f26120deb),
    ("phi3 / f32 / 300", 0xf936426094f942b7),
    ("phi3 / plain rows / 8", 0xd87d3d0ce1c87752),
    ("phi3 / plain rows / 300", 0x3310bc1786f9028e),
    ("phi3 LongRoPE / default / 8", 0x8c4ec187d8203602),
    ("phi3 LongRoPE / default / 300", 0x57f21a597d17ebaa),
    ("phi3 LongRoPE / quantize apart / 8", 0x27db5624bf054460),
    ("phi3 LongRoPE / quantize apart / 300", 0x403b6b6c042de5b0),
    ("phi3 LongRoPE / f32 / 8", 0xaaebc995e3fa3784),
    ("phi3 LongRoPE / f32 / 300", 0x607a8122aac8676c),
    ("phi3 LongRoPE / plain rows / 8", 0x7cd4d55291e4080b),
    ("phi3 LongRoPE / plain rows / 300", 0x0a2bb23774cb53e3),
    ("qwen3moe / default / 8", 0xdc315b1ac10b32cd),
    ("qwen3moe / default / 300", 0x69e9fcc633863f11),
    ("qwen3moe / quantize apart / 8", 0xf65a1ddce7a7a6bd),
    ("qwen3moe / quantize apart / 300", 0x70b0185dab97a761),
    ("qwen3moe / f32 / 8", 0x05db118c9e74b891),
    ("qwen3moe / f32 / 300", 0x8efcb084f95a0405),
    ("qwen3moe / plain rows / 8", 0xbcee5643d15a0bba),
    ("qwen3moe / plain rows / 300", 0xf40cf9db8944ad36),
    ("qwen2moe / default / 8", 0xd14fc2cdc6d6e322),
    ("qwen2moe / default / 300", 0x662449b4bd6b6b02),
    ("qwen2moe / quantize apart / 8", 0x713c7200dc88826c),
    ("qwen2moe / quantize apart / 300", 0x327015b49ec6b18c),
    ("qwen2moe / f32 / 8", 0x1cf438137ad40e60),
    ("qwen2moe / f32 / 300", 0xc3ecd1c92c2b4288),
    ("qwen2moe / plain rows / 8", 0x283982acb9fb6b8b),
    ("qwen2moe / plain rows / 300", 0x33244777a56a1da3),
    ("llama experts / default / 8", 0xd2d96a76129448e6),
    ("llama experts / default / 300", 0xa21cfcb468bd4c0a),
    ("llama experts / quantize apart / 8", 0x00ba680ad1a93bae),
    ("llama experts / quantize apart / 300", 0x636c3b013b065c5a),
    ("llama experts / f32 / 8", 0x12cddad97ee266dc),
    ("llama experts / f32 / 300", 0x54f1af8d6deeebc8),
    ("llama experts / plain rows / 8", 0x4eb9375d3de6e6c9),
    ("llama experts / plain rows / 300", 0x6c40ddf0d2926235),
    ("qwen3next / default / 8", 0x67fa95aeaed47f48),
    ("qwen3next / default / 300", 0x6122ff3117400294),
    ("qwen3next / quantize apart / 8", 0x6f731fd3b1258910),
    ("qwen3next / quantize apart / 300", 0x1ce58af3764357bc),
    ("qwen3next / f32 / 8", 0x4e52edad2a07a660),
    ("qwen3next / f32 / 300", 0xf98fcd371b02f1c8),
    ("qwen3next / plain rows / 8", 0x28e822d495c7e05e),
    ("qwen3next / plain rows / 300", 0x09f70dd7617a8476),
    ("qwen35 / default / 8", 0xdbc2aee953d19184),
    ("qwen35 / default / 300", 0x693276c3f7642834),
    ("qwen35 / quantize apart / 8", 0x6db9c3e3c40ecc4e),
    ("qwen35 / quantize apart / 300", 0x7b59e66ff31e1d42),
    ("qwen35 / f32 / 8", 0x4ac584a458c88e39),
    ("qwen35 / f32 / 300", 0x96208a0700772f65),
    ("qwen35 / plain rows / 8", 0xd91b28c222fa6605),
    ("qwen35 / plain rows / 300", 0x9af9d720d2d281f5),
    ("qwen35moe / default / 8", 0x669e7eb2192b7658),
    ("qwen35moe / default / 300", 0x616847780903bd8a),
    ("qwen35moe / quantize apart / 8", 0x4388c3f258076f46),
    ("qwen35moe / quantize apart / 300", 0xe14fba1513291760),
    ("qwen35moe / f32 / 8", 0x4636b7173caea215),
    ("qwen35moe / f32 / 300", 0x076217a34385aa27),
    ("qwen35moe / plain rows / 8", 0xd4cc8a21e2ea85a5),
    ("qwen35moe / plain rows / 300", 0xb16385b7417e8967),
    ("qwen3next split / default / 8", 0xfbea850db93894a7),
    ("qwen3next split / default / 300", 0xdce4d665042840e9),
    ("qwen3next split / quantize apart / 8", 0x1efab557ed68174f),
    ("qwen3next split / quantize apart / 300", 0x4e46e4c5554c9499),
    ("qwen3next split / f32 / 8", 0x4e9bc5cdec3760f1),
    ("qwen3next split / f32 / 300", 0x5ccc9d0b4e3e3987),
    ("qwen3next split / plain rows / 8", 0x35d332ee4c790571),
    ("qwen3next split / plain rows / 300", 0x694010f4008978af),
    ("llama YaRN / default / 8", 0xf8c9e89ded91bc59),
    ("llama YaRN / default / 300", 0xcba774570b202395),
    ("llama YaRN / quantize apart / 8", 0x5a7ca9d442700045),
    ("llama YaRN / quantize apart / 300", 0xb8dc6393ce1b9d35),
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
        0x672a1da9bedc58ef,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 300",
        0x854887952066999e,
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
    ("llama Q4_0 / quantize apart / 8", 0x75ea3cd41e8e72d3),
    ("llama Q4_0 / quantize apart / 300", 0x5f61b7f8680583ee),
    ("llama Q4_0 / f32 / 8", 0xcade7920975e854a),
    ("llama Q4_0 / f32 / 300", 0x2bf6f5bb8243c881),
    ("llama Q4_0 / plain rows / 8", 0x64852cbf8e848e13),
    ("llama Q4_0 / plain rows / 300", 0x760d6cf06c34d24e),
    ("llama mixed types / default / 8", 0x1764f0f9b9af21d0),
    ("llama mixed types / default / 300", 0x83b4db6ff14582bd),
    ("llama mixed types / quantize apart / 8", 0x46d187489964df00),
    (
        "llama mixed types / quantize apart / 300",
        0x90e3c3fc2a860d39,
    ),
    ("llama mixed types / f32 / 8", 0xdea4a296cdc9b06f),
    ("llama mixed types / f32 / 300", 0x46914e820f26e51c),
    ("llama mixed types / plain rows / 8", 0x89b91a38659020f6),
    ("llama mixed types / plain rows / 300", 0xb949bf5ee48ce93f),
    ("dots1 / default / 8", 0x72ec03c61746851a),
    ("dots1 / default / 300", 0x0056a4838372a19e),
    ("dots1 / quantize apart / 8", 0xefc2a80558c2c5fe),
    ("dots1 / quantize apart / 300", 0x797d51dd1c8f1052),
    ("dots1 / f32 / 8", 0xf101d2760994c265),
    ("dots1 / f32 / 300", 0x4c7b20b02066bf6d),
    ("dots1 / plain rows / 8", 0x207c7fb41cedf561),
    ("dots1 / plain rows / 300", 0x1c1bd0e2a13738dd),
    ("gpt-oss / default / 8", 0x4bd6facd19047881),
    ("gpt-oss / default / 300", 0x64331e14676a7fcc),
    ("gpt-oss / quantize apart / 8", 0x9a91294e2cd6e72d),
    ("gpt-oss / quantize apart / 300", 0x1368309ababcd4c4),
    ("gpt-oss / f32 / 8", 0x9f0dd568d825a8db),
    ("gpt-oss / f32 / 300", 0xaa6873dfc1986f86),
    ("gpt-oss / plain rows / 8", 0x51141212d223adec),
    ("gpt-oss / plain rows / 300", 0xf48d93965bd2fadb),
    ("llama 4 layers / default / 8", 0x781ab9ffee0f10b5),
    ("llama 4 layers / default / 300", 0xd9999c6c117cccec),
    ("llama 4 layers / quantize apart / 8", 0x1da9fa039c60be13),
    ("llama 4 layers / quantize apart / 300", 0xc7c47119052df92e),
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
        let unmeasured = CudaTuning {
            producer_quantize: true,
            fused_moe_combine: true,
            rope_in_attention: true,
            ..CudaTuning::default()
        };
        for (_, tuning) in tunings().into_iter().chain([("unmeasured", unmeasured)]) {
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
