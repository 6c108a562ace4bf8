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
    ("llama / default / 8", 0xb2f0d019f8ad8e6b),
    ("llama / default / 300", 0x5b0f169c9f359c8b),
    ("llama / quantize apart / 8", 0x50e3fe71fcb77063),
    ("llama / quantize apart / 300", 0x2cc7bfce752bcfcf),
    ("llama / f32 / 8", 0x15b194d53e8afc7f),
    ("llama / f32 / 300", 0xc0834ef3e9d0dc3f),
    ("llama / plain rows / 8", 0x83bf52a26a079d28),
    ("llama / plain rows / 300", 0x74a1815d8c717ca0),
    ("qwen2 / default / 8", 0x1fc9537b3c5227db),
    ("qwen2 / default / 300", 0x4ebf5b6d98ae1dbf),
    ("qwen2 / quantize apart / 8", 0x83a7496ea6fd769b),
    ("qwen2 / quantize apart / 300", 0xdc9c760e389b4d8b),
    ("qwen2 / f32 / 8", 0xfd076235624a87ef),
    ("qwen2 / f32 / 300", 0xdf02eb7e8071a36b),
    ("qwen2 / plain rows / 8", 0xeedd0bb3cea56c00),
    ("qwen2 / plain rows / 300", 0x668e60f9d1fe4a8c),
    ("qwen3 / default / 8", 0x565a9d5a99f95ecc),
    ("qwen3 / default / 300", 0x42d7e684a61fc498),
    ("qwen3 / quantize apart / 8", 0xe2ea3964f93d5b80),
    ("qwen3 / quantize apart / 300", 0xcf5a0f1235064bb8),
    ("qwen3 / f32 / 8", 0xb3b526a35dd556b6),
    ("qwen3 / f32 / 300", 0x4fcb09221890b222),
    ("qwen3 / plain rows / 8", 0x93c62c0b3905f7f9),
    ("qwen3 / plain rows / 300", 0x015ab57d40e67fb5),
    ("gemma2 / default / 8", 0x46d9e4f95dffb501),
    ("gemma2 / default / 300", 0xddcef4d404e1e455),
    ("gemma2 / quantize apart / 8", 0x0bb58240bd3f2f41),
    ("gemma2 / quantize apart / 300", 0x137964daf15b5db1),
    ("gemma2 / f32 / 8", 0xeed25c1a70e8ba3f),
    ("gemma2 / f32 / 300", 0x9ebcc1ec4d390773),
    ("gemma2 / plain rows / 8", 0xc39697204bac1e88),
    ("gemma2 / plain rows / 300", 0x4c8e87f7503c01dc),
    ("gemma3 / default / 8", 0xabd380e103e37fd7),
    ("gemma3 / default / 300", 0x8c1ad0f06d2da3e7),
    ("gemma3 / quantize apart / 8", 0xb23b182f539e5ab9),
    ("gemma3 / quantize apart / 300", 0xe4c2d2c1e3c0d63d),
    ("gemma3 / f32 / 8", 0xf0d1d288ac16f37f),
    ("gemma3 / f32 / 300", 0xf837ed5076480b97),
    ("gemma3 / plain rows / 8", 0x85af413c731cf4e2),
    ("gemma3 / plain rows / 300", 0x51075c3cc207dd5a),
    ("granite / default / 8", 0x3710170a5341573b),
    ("granite / default / 300", 0x4df9210dda20b04f),
    ("granite / quantize apart / 8", 0xb679704fe1a72ec5),
    ("granite / quantize apart / 300", 0x5783fb2b7415abb1),
    ("granite / f32 / 8", 0xd2b2eb7d8d9e8719),
    ("granite / f32 / 300", 0x49848f1a3fe2720d),
    ("granite / plain rows / 8", 0x309a9d97ff5930e4),
    ("granite / plain rows / 300", 0x984808fbc614b1f8),
    ("phi3 / default / 8", 0x0555a7bef6bbcc4d),
    ("phi3 / default / 300", 0x724a923afa871ee1),
    ("phi3 / quantize apart / 8", 0xefb6e1cb5956a3cb),
    ("phi3 / quantize apart / 300", 0x63b8143aff407517),
    ("phi3 / f32 / 8", 0x8c119e5c950bf263),
    ("phi3 / f32 / 300", 0xeeb79adbcb45048f),
    ("phi3 / plain rows / 8", 0x34b76d6b7d7ec0ce),
    ("phi3 / plain rows / 300", 0x6e1ab66630c52d9a),
    ("phi3 LongRoPE / default / 8", 0x8724b96c666ebb56),
    ("phi3 LongRoPE / default / 300", 0x0a16162fcee7db8e),
    ("phi3 LongRoPE / quantize apart / 8", 0xbc78bb848d5fb248),
    ("phi3 LongRoPE / quantize apart / 300", 0xfbe65af2c25d4968),
    ("phi3 LongRoPE / f32 / 8", 0xd08f308598dfb2a8),
    ("phi3 LongRoPE / f32 / 300", 0x76215c74c411be00),
    ("phi3 LongRoPE / plain rows / 8", 0x1d1ec5a708c008d3),
    ("phi3 LongRoPE / plain rows / 300", 0xbaa1747843b0d57b),
    ("qwen3moe / default / 8", 0x742ff172f20e27a9),
    ("qwen3moe / default / 300", 0xb2535fdba673cf35),
    ("qwen3moe / quantize apart / 8", 0x10462ae233b518a9),
    ("qwen3moe / quantize apart / 300", 0x937cf4186e2a4245),
    ("qwen3moe / f32 / 8", 0x3140ccbe43fa89b9),
    ("qwen3moe / f32 / 300", 0xb46847e4ec8896c5),
    ("qwen3moe / plain rows / 8", 0xbb995e1f5ed8f74e),
    ("qwen3moe / plain rows / 300", 0x65c4cfbb7a643752),
    ("qwen2moe / default / 8", 0x6fef18f7c2a27f38),
    ("qwen2moe / default / 300", 0x58b5096f68984e70),
    ("qwen2moe / quantize apart / 8", 0x273c0f841935a8f2),
    ("qwen2moe / quantize apart / 300", 0x1689b5d51bc75f8a),
    ("qwen2moe / f32 / 8", 0x704fd1bf725c3346),
    ("qwen2moe / f32 / 300", 0x8c988f06ed33a266),
    ("qwen2moe / plain rows / 8", 0xdf62774390ebf9ed),
    ("qwen2moe / plain rows / 300", 0x2bb2a4b1777e0bfd),
    ("llama experts / default / 8", 0x20d198a586235f1c),
    ("llama experts / default / 300", 0x1768e494690e2750),
    ("llama experts / quantize apart / 8", 0x4d606060d7603d94),
    ("llama experts / quantize apart / 300", 0xcace94777f9748a0),
    ("llama experts / f32 / 8", 0xebfb0e02b7997420),
    ("llama experts / f32 / 300", 0xc06e812510c6efec),
    ("llama experts / plain rows / 8", 0xd6b25dbb17616c8b),
    ("llama experts / plain rows / 300", 0xa3d44e4b7d0e20ff),
    ("qwen3next / default / 8", 0xfa1af66afeb35cc4),
    ("qwen3next / default / 300", 0x01a3d3002e144d08),
    ("qwen3next / quantize apart / 8", 0xdf3feb7ff24360d2),
    ("qwen3next / quantize apart / 300", 0x2f9f4e00735948fe),
    ("qwen3next / f32 / 8", 0xb3e40abd7dba8f9a),
    ("qwen3next / f32 / 300", 0x058c3e1807bee362),
    ("qwen3next / plain rows / 8", 0x08cba8031b8a537a),
    ("qwen3next / plain rows / 300", 0xc7c1e043617ed2e2),
    ("qwen35 / default / 8", 0xde590efa7cceb3bc),
    ("qwen35 / default / 300", 0x12f15f713dd34bcc),
    ("qwen35 / quantize apart / 8", 0xf818e787d2f6ac06),
    ("qwen35 / quantize apart / 300", 0x616fc5f49c7f237a),
    ("qwen35 / f32 / 8", 0x62f4c7543fb062d1),
    ("qwen35 / f32 / 300", 0x3dbd32f733cb897d),
    ("qwen35 / plain rows / 8", 0x2bf85bc6040e1fd1),
    ("qwen35 / plain rows / 300", 0x8114f6bae8aef0f1),
    ("qwen35moe / default / 8", 0x07752a1252aaba22),
    ("qwen35moe / default / 300", 0xf1bf26f07869fbb0),
    ("qwen35moe / quantize apart / 8", 0x749209143c56a454),
    ("qwen35moe / quantize apart / 300", 0x887d70067ae55482),
    ("qwen35moe / f32 / 8", 0xaeb0c0d09ebaabcb),
    ("qwen35moe / f32 / 300", 0x25d4be0bff82e829),
    ("qwen35moe / plain rows / 8", 0xec4bf2c3b41ab7eb),
    ("qwen35moe / plain rows / 300", 0xea97970f8d665cc9),
    ("qwen3next split / default / 8", 0x50597241b7e34b4d),
    ("qwen3next split / default / 300", 0x4ba41f68e77a4e3b),
    ("qwen3next split / quantize apart / 8", 0x70b38970d9003fd9),
    ("qwen3next split / quantize apart / 300", 0x0be41c7c942009c7),
    ("qwen3next split / f32 / 8", 0x82ed51f4257b9cb3),
    ("qwen3next split / f32 / 300", 0x0d5388829691c4e5),
    ("qwen3next split / plain rows / 8", 0xd3f8d2bfdf3162f3),
    ("qwen3next split / plain rows / 300", 0x38412af0ae2840b5),
    ("llama YaRN / default / 8", 0x79000d46737c3df5),
    ("llama YaRN / default / 300", 0x64b730d6a6d24a51),
    ("llama YaRN / quantize apart / 8", 0x7fd15fef4bbdd809),
    ("llama YaRN / quantize apart / 300", 0x49016197be766e79),
    ("llama YaRN / f32 / 8", 0x108b8008798655a9),
    ("llama YaRN / f32 / 300", 0xc8286c8dbe3787d5),
    ("llama YaRN / plain rows / 8", 0x972b56365f10627a),
    ("llama YaRN / plain rows / 300", 0x2b6316ee5fcbac4e),
    (
        "llama Q4_K, frequency factors, tied / default / 8",
        0xf0a115ee856f0191,
    ),
    (
        "llama Q4_K, frequency factors, tied / default / 300",
        0x6e0cbdffcd74c56c,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 8",
        0x1e19e4889c22a54b,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 300",
        0xe5f77183eeaa92a2,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 8",
        0x68ebfbd716cb6973,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 300",
        0x258f0834b4a28fee,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 8",
        0x62612605531c278e,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 300",
        0x6fd30f57202e6617,
    ),
    ("llama Q4_0 / default / 8", 0xc19a5b33da0cdd3f),
    ("llama Q4_0 / default / 300", 0xce51bc8d2159e672),
    ("llama Q4_0 / quantize apart / 8", 0x6957af0df76eed83),
    ("llama Q4_0 / quantize apart / 300", 0xaeb7b056b8595e52),
    ("llama Q4_0 / f32 / 8", 0x17adf4e3b019780a),
    ("llama Q4_0 / f32 / 300", 0x49468156e0e23ad1),
    ("llama Q4_0 / plain rows / 8", 0x70b8ce75671eb0a3),
    ("llama Q4_0 / plain rows / 300", 0x47b6c6ece59d2e5e),
    ("llama mixed types / default / 8", 0x69b5050395498cf4),
    ("llama mixed types / default / 300", 0x173ba3bcfe86480d),
    ("llama mixed types / quantize apart / 8", 0x84c277dabed138f4),
    (
        "llama mixed types / quantize apart / 300",
        0x3ba52331d956ed95,
    ),
    ("llama mixed types / f32 / 8", 0x25126e011eafc86f),
    ("llama mixed types / f32 / 300", 0xcbc1f3e379391dd0),
    ("llama mixed types / plain rows / 8", 0xc52bf4c0482c1346),
    ("llama mixed types / plain rows / 300", 0x6c0700b37f834a03),
    ("dots1 / default / 8", 0x0f28f738d2ef00a6),
    ("dots1 / default / 300", 0x34ae289b04ffa46a),
    ("dots1 / quantize apart / 8", 0xc86f7db862313bfa),
    ("dots1 / quantize apart / 300", 0xbd752fd76b0b41ce),
    ("dots1 / f32 / 8", 0x576a8ae5ccd1af11),
    ("dots1 / f32 / 300", 0xf3635aaecb498cd9),
    ("dots1 / plain rows / 8", 0x3b87dbe36aea3f81),
    ("dots1 / plain rows / 300", 0xa1789f7d17673bed),
    ("gpt-oss / default / 8", 0x4eeb438355fa4a37),
    ("gpt-oss / default / 300", 0xe42dac30ae3abe9e),
    ("gpt-oss / quantize apart / 8", 0x59f5d501491a8e13),
    ("gpt-oss / quantize apart / 300", 0xebddb0f55aea61fe),
    ("gpt-oss / f32 / 8", 0x497788aca5f752fb),
    ("gpt-oss / f32 / 300", 0xb570eb2a49a75302),
    ("gpt-oss / plain rows / 8", 0x195838186dd4c0e2),
    ("gpt-oss / plain rows / 300", 0x046fbf24652fcb5d),
    ("llama 4 layers / default / 8", 0xf053eeddb3251b99),
    ("llama 4 layers / default / 300", 0x621eff160ffc4a90),
    ("llama 4 layers / quantize apart / 8", 0xfe320d0350938e13),
    ("llama 4 layers / quantize apart / 300", 0xfd5a2e2517df273e),
    ("llama 4 layers / f32 / 8", 0xef2d76ea90b7ba11),
    ("llama 4 layers / f32 / 300", 0x96cac7d8773f1e00),
    ("llama 4 layers / plain rows / 8", 0xb0767a7ca4482fc2),
    ("llama 4 layers / plain rows / 300", 0x40fec6823e3428c1),
    ("llama 4 layers / first 1", 0x23cb4d0cfd35d800),
    ("llama 4 layers / first 2", 0xcf9d3dfddf4c2bec),
    ("llama tied false / rank 0 of 2", 0xd6fdaea106f4ffb2),
    ("llama tied false / rank 1 of 2", 0x0a462e3d2288aedc),
    ("llama tied false / rank 0 of 4", 0x29430636bf7a2e58),
    ("llama tied false / rank 1 of 4", 0xeaeaa75c184d5521),
    ("llama tied false / rank 2 of 4", 0x345bfbde087bf1a1),
    ("llama tied false / rank 3 of 4", 0x4ebf65cc4c88abec),
    ("llama tied true / rank 0 of 2", 0x514a9c01f4dfd915),
    ("llama tied true / rank 1 of 2", 0x6504f281e51473a0),
    ("llama tied true / rank 0 of 4", 0x6786c2063e5ef9bc),
    ("llama tied true / rank 1 of 4", 0xd7e766cac34f549f),
    ("llama tied true / rank 2 of 4", 0xe4cd3c3cf468240c),
    ("llama tied true / rank 3 of 4", 0x164e5e2eb5ed59ae),
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
