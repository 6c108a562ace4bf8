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
    ("llama / default / 8", 0x4902f5ac4cbcc9db),
    ("llama / default / 300", 0xc5fdfee0cc2d23db),
    ("llama / quantize apart / 8", 0xb9c603d953cf13f3),
    ("llama / quantize apart / 300", 0xfc7d4f07a98e15bf),
    ("llama / f32 / 8", 0x447cbda562811b13),
    ("llama / f32 / 300", 0x765b8999e57e16a3),
    ("llama / plain rows / 8", 0x3013ef08a179f000),
    ("llama / plain rows / 300", 0xa4dbadc412bc33d8),
    ("qwen2 / default / 8", 0xb34599ffb5cd701f),
    ("qwen2 / default / 300", 0xa9b1b1c5fbe38163),
    ("qwen2 / quantize apart / 8", 0xe55ee8a691ca5a77),
    ("qwen2 / quantize apart / 300", 0x1950bf75bc8a1877),
    ("qwen2 / f32 / 8", 0xc9412f053027e177),
    ("qwen2 / f32 / 300", 0xc46a3c48dca5ac93),
    ("qwen2 / plain rows / 8", 0xeb12a81095cf70c4),
    ("qwen2 / plain rows / 300", 0xb0dd7c4a50f12cd0),
    ("qwen3 / default / 8", 0x1fa5c04e371540e0),
    ("qwen3 / default / 300", 0x903d4cda4eb56bfc),
    ("qwen3 / quantize apart / 8", 0xc2e29febf3886cfc),
    ("qwen3 / quantize apart / 300", 0xdea00d3f2e093d04),
    ("qwen3 / f32 / 8", 0xc27cc1b0d36b9e9a),
    ("qwen3 / f32 / 300", 0x4a6a8464a8e3c9c6),
    ("qwen3 / plain rows / 8", 0x5cb09e7e4e1f40b9),
    ("qwen3 / plain rows / 300", 0xfd124eb172a8e9f5),
    ("gemma2 / default / 8", 0xb5af1cd1b712966f),
    ("gemma2 / default / 300", 0x41092a9befd5523b),
    ("gemma2 / quantize apart / 8", 0x02b19b23ea8f5187),
    ("gemma2 / quantize apart / 300", 0x5ebed1a10081889f),
    ("gemma2 / f32 / 8", 0x10a07edc2b067d5d),
    ("gemma2 / f32 / 300", 0x4e54955f67285b79),
    ("gemma2 / plain rows / 8", 0x8c6269480626e866),
    ("gemma2 / plain rows / 300", 0x7c16a3d531b60e32),
    ("gemma3 / default / 8", 0x7fa279990dd84eb3),
    ("gemma3 / default / 300", 0x2aadb66c60581c03),
    ("gemma3 / quantize apart / 8", 0x14d7dbcb111185b9),
    ("gemma3 / quantize apart / 300", 0xe3af05624627129d),
    ("gemma3 / f32 / 8", 0x4e0a6fcad33f6a2b),
    ("gemma3 / f32 / 300", 0x235a86869c47b693),
    ("gemma3 / plain rows / 8", 0x8b0c6dac3cd10f1a),
    ("gemma3 / plain rows / 300", 0xeb554eba7e5fa182),
    ("granite / default / 8", 0xfb81abe0cd11254b),
    ("granite / default / 300", 0xca85daa8c8a05307),
    ("granite / quantize apart / 8", 0x2b3879698f9a0859),
    ("granite / quantize apart / 300", 0xf308799b7259dc75),
    ("granite / f32 / 8", 0xf6d678e9a61ee291),
    ("granite / f32 / 300", 0xa6c84affd342042d),
    ("granite / plain rows / 8", 0x7e43e01ee12a3308),
    ("granite / plain rows / 300", 0x7b4cf596f782f9f4),
    ("phi3 / default / 8", 0x4d0166b5ee972179),
    ("phi3 / default / 300", 0x7ff30ad83f5a4f4d),
    ("phi3 / quantize apart / 8", 0x74680b692941087b),
    ("phi3 / quantize apart / 300", 0xc172799d70bb11d7),
    ("phi3 / f32 / 8", 0x53701a5ed7d219cf),
    ("phi3 / f32 / 300", 0x7046b80a895d9afb),
    ("phi3 / plain rows / 8", 0xcef6a2034392e62e),
    ("phi3 / plain rows / 300", 0x588fdf99a4194b7a),
    ("phi3 LongRoPE / default / 8", 0xd2d0c316531238ae),
    ("phi3 LongRoPE / default / 300", 0xfbaf7dff86487676),
    ("phi3 LongRoPE / quantize apart / 8", 0xeea60b02d26167c4),
    ("phi3 LongRoPE / quantize apart / 300", 0xd8e5a253194776c4),
    ("phi3 LongRoPE / f32 / 8", 0x60488b6c2c199948),
    ("phi3 LongRoPE / f32 / 300", 0x6f68316b3a188580),
    ("phi3 LongRoPE / plain rows / 8", 0xffb1eccc9e8ac457),
    ("phi3 LongRoPE / plain rows / 300", 0xd07d3ce76251066f),
    ("qwen3moe / default / 8", 0xe4e8e5e0b2546271),
    ("qwen3moe / default / 300", 0x8f91ed886962cbe5),
    ("qwen3moe / quantize apart / 8", 0x399ed8705ea1e2f9),
    ("qwen3moe / quantize apart / 300", 0x801a9e4a14a494cd),
    ("qwen3moe / f32 / 8", 0xbdd2be294731944d),
    ("qwen3moe / f32 / 300", 0x2e05ec24c040e9e1),
    ("qwen3moe / plain rows / 8", 0xcbd170e9107e3c26),
    ("qwen3moe / plain rows / 300", 0x175029a113b60ec2),
    ("qwen2moe / default / 8", 0xe59608b632dcd532),
    ("qwen2moe / default / 300", 0x17ca1e21f71380c2),
    ("qwen2moe / quantize apart / 8", 0xb0219ccaf01720cc),
    ("qwen2moe / quantize apart / 300", 0x92f7e44d5262a16c),
    ("qwen2moe / f32 / 8", 0x5e59cbc8317afad8),
    ("qwen2moe / f32 / 300", 0x063d916b8477e950),
    ("qwen2moe / plain rows / 8", 0x812e4c04f5ffea9b),
    ("qwen2moe / plain rows / 300", 0xb1e41ad01a0dd0e3),
    ("llama experts / default / 8", 0x5be26175190a2c4a),
    ("llama experts / default / 300", 0xc80b6298012e855e),
    ("llama experts / quantize apart / 8", 0x8e7531a6a90762e2),
    ("llama experts / quantize apart / 300", 0xae3bf6b299d2679e),
    ("llama experts / f32 / 8", 0xc6869fe19617ead8),
    ("llama experts / f32 / 300", 0x8e6bcfb2207206a4),
    ("llama experts / plain rows / 8", 0xe226e0e54b7b68bd),
    ("llama experts / plain rows / 300", 0xda42c83978dc8759),
    ("qwen3next / default / 8", 0x5bd05897c2a2e06d),
    ("qwen3next / default / 300", 0x8cee262ced8076c5),
    ("qwen3next / quantize apart / 8", 0xc1ab9cc6dea6989b),
    ("qwen3next / quantize apart / 300", 0xf4dbf3631ce17c23),
    ("qwen3next / f32 / 8", 0x3b49d52bfd3e8870),
    ("qwen3next / f32 / 300", 0x2294a6211ff6afd8),
    ("qwen3next / plain rows / 8", 0x5af8d2e0d9d4f1ae),
    ("qwen3next / plain rows / 300", 0x7445d0a118506a06),
    ("qwen35 / default / 8", 0xb4047050d1d842ce),
    ("qwen35 / default / 300", 0x8ec0613d9fc2413e),
    ("qwen35 / quantize apart / 8", 0x6a3d8fee7bc2d7f0),
    ("qwen35 / quantize apart / 300", 0xdd6b05d74b43e6fc),
    ("qwen35 / f32 / 8", 0x7808bade77ec3c37),
    ("qwen35 / f32 / 300", 0xd74d15e155b5eb3b),
    ("qwen35 / plain rows / 8", 0xec443fdb3d5b632f),
    ("qwen35 / plain rows / 300", 0x9bfc7e9a6f06600f),
    ("qwen35moe / default / 8", 0xbc83cf3ab5c5f4d6),
    ("qwen35moe / default / 300", 0x750ff9a34a9cf3d0),
    ("qwen35moe / quantize apart / 8", 0x864c223b7be71c8c),
    ("qwen35moe / quantize apart / 300", 0x7d16f5bdae1857ee),
    ("qwen35moe / f32 / 8", 0xb00797d400a33eb3),
    ("qwen35moe / f32 / 300", 0xa00183c8ad9c64e5),
    ("qwen35moe / plain rows / 8", 0xfcbddbe1513e56b3),
    ("qwen35moe / plain rows / 300", 0x7516f0e13e115485),
    ("qwen3next split / default / 8", 0x554c2e385ec7d800),
    ("qwen3next split / default / 300", 0x231be1bc9757feaa),
    ("qwen3next split / quantize apart / 8", 0x94b0cf4313b4e6de),
    ("qwen3next split / quantize apart / 300", 0xa9a5e2ca8aaef700),
    ("qwen3next split / f32 / 8", 0x09c60e68d6d74a4e),
    ("qwen3next split / f32 / 300", 0x1414d6ffc8240b84),
    ("qwen3next split / plain rows / 8", 0x4f151054d51bb1b4),
    ("qwen3next split / plain rows / 300", 0x558a784dd7f2b732),
    ("llama YaRN / default / 8", 0x3aa7f5db87bfc1c5),
    ("llama YaRN / default / 300", 0x03479b50e58030e1),
    ("llama YaRN / quantize apart / 8", 0x79fb03ac696a0041),
    ("llama YaRN / quantize apart / 300", 0x2850a9cbdfda5a91),
    ("llama YaRN / f32 / 8", 0x835015c0503bcced),
    ("llama YaRN / f32 / 300", 0x4375dc40247e9f59),
    ("llama YaRN / plain rows / 8", 0x09ae2d7800b4a982),
    ("llama YaRN / plain rows / 300", 0xea697f2d01c1c916),
    (
        "llama Q4_K, frequency factors, tied / default / 8",
        0xad9a9e27d4be02c9,
    ),
    (
        "llama Q4_K, frequency factors, tied / default / 300",
        0xb2d4da2da74cfc00,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 8",
        0x0c64ee59734b1e77,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 300",
        0x2fa23777a6b64f56,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 8",
        0x3db0a9b8b5ae855f,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 300",
        0xc73a5ca19a4129ce,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 8",
        0x70d96e5094263cfe,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 300",
        0x8b20b177ad2b43db,
    ),
    ("llama Q4_0 / default / 8", 0x88aaa546da7f1557),
    ("llama Q4_0 / default / 300", 0x69af5ff0e0b5f17a),
    ("llama Q4_0 / quantize apart / 8", 0x0b485f6f58b24c77),
    ("llama Q4_0 / quantize apart / 300", 0x141e839f6fd7435a),
    ("llama Q4_0 / f32 / 8", 0x5833728853df1562),
    ("llama Q4_0 / f32 / 300", 0x9a370570b39036e1),
    ("llama Q4_0 / plain rows / 8", 0x163ff5214b08424b),
    ("llama Q4_0 / plain rows / 300", 0x39a229187fe45fe6),
    ("llama mixed types / default / 8", 0x3135ba7e9ebd0fd8),
    ("llama mixed types / default / 300", 0x3a8a1a6a85fcb5d5),
    ("llama mixed types / quantize apart / 8", 0x7419170986800efc),
    (
        "llama mixed types / quantize apart / 300",
        0x54900ea9d8e85a5d,
    ),
    ("llama mixed types / f32 / 8", 0x825e072d61bc61d7),
    ("llama mixed types / f32 / 300", 0xacea407dca3f8e0c),
    ("llama mixed types / plain rows / 8", 0x3f49fc4b07381262),
    ("llama mixed types / plain rows / 300", 0xe4d77f37351da68b),
    ("dots1 / default / 8", 0x23275f900e891452),
    ("dots1 / default / 300", 0xde64b700f8fb5d46),
    ("dots1 / quantize apart / 8", 0x7c75065f38b56c3e),
    ("dots1 / quantize apart / 300", 0xb2b1c41a0548a5d2),
    ("dots1 / f32 / 8", 0xbcfff0c0329dc2e5),
    ("dots1 / f32 / 300", 0x2d3c6f2c4558d1fd),
    ("dots1 / plain rows / 8", 0x81793e420d53b9f9),
    ("dots1 / plain rows / 300", 0xf77b3cc11a3c3605),
    ("gpt-oss / default / 8", 0x768b058907aff529),
    ("gpt-oss / default / 300", 0x2b2ed65b53376d44),
    ("gpt-oss / quantize apart / 8", 0x4ab4d271a9857d3d),
    ("gpt-oss / quantize apart / 300", 0xa8de23c61a11845c),
    ("gpt-oss / f32 / 8", 0xa2fca360957ec223),
    ("gpt-oss / f32 / 300", 0xf92cf6aec7cd264e),
    ("gpt-oss / plain rows / 8", 0xfb6db963bb55d724),
    ("gpt-oss / plain rows / 300", 0x39d80103f4e2220b),
    ("llama 4 layers / default / 8", 0xeb51438b43f297b9),
    ("llama 4 layers / default / 300", 0x8229d9fe525d4100),
    ("llama 4 layers / quantize apart / 8", 0x722f051466581e8f),
    ("llama 4 layers / quantize apart / 300", 0x13c28d489b92f85a),
    ("llama 4 layers / f32 / 8", 0xb05c5456d43d7919),
    ("llama 4 layers / f32 / 300", 0x91cd3a45379b0dd0),
    ("llama 4 layers / plain rows / 8", 0xeb5364a8560d676e),
    ("llama 4 layers / plain rows / 300", 0x39e414847c739175),
    ("llama 4 layers / first 1", 0xb27ff1ed0b196ce6),
    ("llama 4 layers / first 2", 0xf204a1bbe0b1afa0),
    ("llama tied false / rank 0 of 2", 0x31da2a56cd1e0716),
    ("llama tied false / rank 1 of 2", 0xc9bbd88531d4f128),
    ("llama tied false / rank 0 of 4", 0xad04b3ca4f921bf8),
    ("llama tied false / rank 1 of 4", 0xc87225edaf6cc8b1),
    ("llama tied false / rank 2 of 4", 0x9c82851f42c8bd31),
    ("llama tied false / rank 3 of 4", 0xc3d4deaddb34788c),
    ("llama tied true / rank 0 of 2", 0xb0b6f009fe901889),
    ("llama tied true / rank 1 of 2", 0xf3f9df8f5106ddbc),
    ("llama tied true / rank 0 of 4", 0xf32b549beefd67fc),
    ("llama tied true / rank 1 of 4", 0x422168b3ec07481f),
    ("llama tied true / rank 2 of 4", 0xdd8cd1abe117d8ac),
    ("llama tied true / rank 3 of 4", 0x81dad33ab578b21e),
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
