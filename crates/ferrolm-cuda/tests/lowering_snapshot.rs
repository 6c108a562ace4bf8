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
    ("qwen3moe / default / 8", 0x1a6970a145b6bfc9),
    ("qwen3moe / default / 300", 0xb45e6cb3ea4d71d5),
    ("qwen3moe / quantize apart / 8", 0x3dfc4193c85ceb39),
    ("qwen3moe / quantize apart / 300", 0xfd709676d4529c15),
    ("qwen3moe / f32 / 8", 0xd23a258223443e71),
    ("qwen3moe / f32 / 300", 0x81d0bb801a65003d),
    ("qwen3moe / plain rows / 8", 0x33be5b566328a83e),
    ("qwen3moe / plain rows / 300", 0xe7e67d14998bfe92),
    ("qwen2moe / default / 8", 0xaa7dccea2d271a76),
    ("qwen2moe / default / 300", 0x8ebb313ff9715b3e),
    ("qwen2moe / quantize apart / 8", 0x6679d306683e7fbc),
    ("qwen2moe / quantize apart / 300", 0xb2bde5763f17e5d4),
    ("qwen2moe / f32 / 8", 0x9c330e79d4e8548c),
    ("qwen2moe / f32 / 300", 0x8cb3daa3b35f583c),
    ("qwen2moe / plain rows / 8", 0xcec7d34650c81407),
    ("qwen2moe / plain rows / 300", 0xd7b2643864fc6b77),
    ("llama experts / default / 8", 0x0c3c423dbfa9d65c),
    ("llama experts / default / 300", 0x7b98396d646c8730),
    ("llama experts / quantize apart / 8", 0xd2fa7dea10cd18f4),
    ("llama experts / quantize apart / 300", 0x8eba8e28ab087180),
    ("llama experts / f32 / 8", 0xe106873e3a2325c8),
    ("llama experts / f32 / 300", 0xd6a71d558b40b974),
    ("llama experts / plain rows / 8", 0x980cc6c354b49a7b),
    ("llama experts / plain rows / 300", 0xfce1ed9a0d3c634f),
    ("qwen3next / default / 8", 0x3dfe12a2da0b84a6),
    ("qwen3next / default / 300", 0x0678f21d858498f2),
    ("qwen3next / quantize apart / 8", 0xb1c4bed55f35b89a),
    ("qwen3next / quantize apart / 300", 0x707259aeb0170596),
    ("qwen3next / f32 / 8", 0xecaec7af7a77854a),
    ("qwen3next / f32 / 300", 0x921b9289ee606292),
    ("qwen3next / plain rows / 8", 0x9026fc5f50c5221a),
    ("qwen3next / plain rows / 300", 0xfa9f5a1f08e13772),
    ("qwen35 / default / 8", 0xde590efa7cceb3bc),
    ("qwen35 / default / 300", 0x12f15f713dd34bcc),
    ("qwen35 / quantize apart / 8", 0xf818e787d2f6ac06),
    ("qwen35 / quantize apart / 300", 0x616fc5f49c7f237a),
    ("qwen35 / f32 / 8", 0x62f4c7543fb062d1),
    ("qwen35 / f32 / 300", 0x3dbd32f733cb897d),
    ("qwen35 / plain rows / 8", 0x2bf85bc6040e1fd1),
    ("qwen35 / plain rows / 300", 0x8114f6bae8aef0f1),
    ("qwen35moe / default / 8", 0x207cab5ff455768a),
    ("qwen35moe / default / 300", 0x8a4c21bc2fbaa368),
    ("qwen35moe / quantize apart / 8", 0xb294bda91a61a0f8),
    ("qwen35moe / quantize apart / 300", 0x52eaf4783f9ed29e),
    ("qwen35moe / f32 / 8", 0x1c9a254075c29f49),
    ("qwen35moe / f32 / 300", 0x49e4cd0abeffd03f),
    ("qwen35moe / plain rows / 8", 0x0ff1ed83ea346ec7),
    ("qwen35moe / plain rows / 300", 0x0f66c7f8299f3565),
    ("qwen3next split / default / 8", 0x6118fe5907f2aaab),
    ("qwen3next split / default / 300", 0x5ff40d7023ac0431),
    ("qwen3next split / quantize apart / 8", 0x2bd71b7e0301179b),
    ("qwen3next split / quantize apart / 300", 0xfb61d94fc12de119),
    ("qwen3next split / f32 / 8", 0x1af19113b2baef79),
    ("qwen3next split / f32 / 300", 0x43b3ae4133b2c24b),
    ("qwen3next split / plain rows / 8", 0xf22295fbedcedbaf),
    ("qwen3next split / plain rows / 300", 0x3020bd4ea6caf311),
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
    ("dots1 / default / 8", 0x2420d67c2e2d794a),
    ("dots1 / default / 300", 0x928a4a991d5b9ebe),
    ("dots1 / quantize apart / 8", 0xddb48581b40922d6),
    ("dots1 / quantize apart / 300", 0x8471378cf000981a),
    ("dots1 / f32 / 8", 0x3d22feafb3231d2d),
    ("dots1 / f32 / 300", 0xf5b8bf467782deb5),
    ("dots1 / plain rows / 8", 0xa7373b8fad597ced),
    ("dots1 / plain rows / 300", 0x160d4017cbfd5389),
    ("gpt-oss / default / 8", 0x782e731dbd294487),
    ("gpt-oss / default / 300", 0x0d9325e42293f86e),
    ("gpt-oss / quantize apart / 8", 0x691d4de9ef66b203),
    ("gpt-oss / quantize apart / 300", 0x45d550472f5361be),
    ("gpt-oss / f32 / 8", 0x136e1a693950cda3),
    ("gpt-oss / f32 / 300", 0x19771f08a1ddf83a),
    ("gpt-oss / plain rows / 8", 0x989a72f6c01b1e92),
    ("gpt-oss / plain rows / 300", 0x22170fdb37948dfd),
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
