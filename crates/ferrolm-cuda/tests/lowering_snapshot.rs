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
    ("llama / default / 8", 0x70fb9b1aa4c85a95),
    ("llama / default / 300", 0x103bc89b92d67682),
    ("llama / quantize apart / 8", 0x9f58603e467929a3),
    ("llama / quantize apart / 300", 0xffdf07aa2403505c),
    ("llama / f32 / 8", 0xac4b2bf6b5743675),
    ("llama / f32 / 300", 0x2b75960596a7290e),
    ("llama / plain rows / 8", 0x5d0f0f7444a7dcb2),
    ("llama / plain rows / 300", 0xc7de34601bea7def),
    ("qwen2 / default / 8", 0x5334f2582f7d2dc3),
    ("qwen2 / default / 300", 0xce391732695f2aa0),
    ("qwen2 / quantize apart / 8", 0x5a606d350fc70705),
    ("qwen2 / quantize apart / 300", 0xb7c9e09d8068c5c6),
    ("qwen2 / f32 / 8", 0xc4623b223afd0d1f),
    ("qwen2 / f32 / 300", 0xc552d92fb28b2a54),
    ("qwen2 / plain rows / 8", 0xb485260cc30a0058),
    ("qwen2 / plain rows / 300", 0xe3a438b265102375),
    ("qwen3 / default / 8", 0x2138285f9436d462),
    ("qwen3 / default / 300", 0xa7fa4f25e1e8a9f7),
    ("qwen3 / quantize apart / 8", 0xfd60209c8071dfa8),
    ("qwen3 / quantize apart / 300", 0xefb910b43a0c7cad),
    ("qwen3 / f32 / 8", 0x593374d7bd345f88),
    ("qwen3 / f32 / 300", 0x9eb033b1ba9c24c9),
    ("qwen3 / plain rows / 8", 0x2ef5cb4e1e9feaf7),
    ("qwen3 / plain rows / 300", 0x6fc1ade99d004ac4),
    ("gemma2 / default / 8", 0x8cb807260525cc21),
    ("gemma2 / default / 300", 0x8d34b806fb5b682e),
    ("gemma2 / quantize apart / 8", 0x1222e06e89390b87),
    ("gemma2 / quantize apart / 300", 0x6049e89f946656ac),
    ("gemma2 / f32 / 8", 0x6c43b6b039100fd7),
    ("gemma2 / f32 / 300", 0xc961475ad6f39cf8),
    ("gemma2 / plain rows / 8", 0x156eec04df27a1f8),
    ("gemma2 / plain rows / 300", 0x89bc375f8092c98f),
    ("gemma3 / default / 8", 0xe8d51cb0ebc615a9),
    ("gemma3 / default / 300", 0xbedc91e0f73e35a0),
    ("gemma3 / quantize apart / 8", 0x6bfe98468d29b0b1),
    ("gemma3 / quantize apart / 300", 0x6338ec48aaca1614),
    ("gemma3 / f32 / 8", 0xe78d4703644bd2ed),
    ("gemma3 / f32 / 300", 0x6d991198343e86d8),
    ("gemma3 / plain rows / 8", 0xf16f22a36a795a8c),
    ("gemma3 / plain rows / 300", 0x88c65231d00cf1fd),
    ("granite / default / 8", 0x38095cce95ace399),
    ("granite / default / 300", 0x1b2332d292a49bac),
    ("granite / quantize apart / 8", 0xb2518210d311796b),
    ("granite / quantize apart / 300", 0xb130bad06402907a),
    ("granite / f32 / 8", 0xfc8e68884e8ceb3b),
    ("granite / f32 / 300", 0xecee578b23d47c72),
    ("granite / plain rows / 8", 0x61776e2b359b1272),
    ("granite / plain rows / 300", 0x9f0410a8c6392925),
    ("phi3 / default / 8", 0x7d7abb4799712e8f),
    ("phi3 / default / 300", 0xeb607e3c0613589e),
    ("phi3 / quantize apart / 8", 0x8af176e5863f816d),
    ("phi3 / quantize apart / 300", 0xf6bfa77adeeaddb0),
    ("phi3 / f32 / 8", 0xb0438295d28692dd),
    ("phi3 / f32 / 300", 0x5bd808784894fb2c),
    ("phi3 / plain rows / 8", 0x5d5f331b5c741c48),
    ("phi3 / plain rows / 300", 0xef99d3db2e417a2f),
    ("phi3 LongRoPE / default / 8", 0x4952c3af2f2c5a40),
    ("phi3 LongRoPE / default / 300", 0xff18c35295950981),
    ("phi3 LongRoPE / quantize apart / 8", 0x7cab15c49931b80a),
    ("phi3 LongRoPE / quantize apart / 300", 0x6a365806c1a2c0c7),
    ("phi3 LongRoPE / f32 / 8", 0x8fcf40c2724f7fc2),
    ("phi3 LongRoPE / f32 / 300", 0xe8fb836adeeb0cb3),
    ("phi3 LongRoPE / plain rows / 8", 0xf52336290f14890d),
    ("phi3 LongRoPE / plain rows / 300", 0x18c93b78eaa2216e),
    ("qwen3moe / default / 8", 0x4eb5c4a9787eafbd),
    ("qwen3moe / default / 300", 0x9e1b526557c67ae4),
    ("qwen3moe / quantize apart / 8", 0xf140439edc0750bd),
    ("qwen3moe / quantize apart / 300", 0x0c6934c01905a640),
    ("qwen3moe / f32 / 8", 0x01adf4a558a8d761),
    ("qwen3moe / f32 / 300", 0x6d91c9c9f1aea12c),
    ("qwen3moe / plain rows / 8", 0x54be135f6208b64a),
    ("qwen3moe / plain rows / 300", 0xa145e0b77b453255),
    ("qwen2moe / default / 8", 0x39cff13072fbd8dc),
    ("qwen2moe / default / 300", 0x9ea043c26f5df7f9),
    ("qwen2moe / quantize apart / 8", 0xee9082e2d9ec952a),
    ("qwen2moe / quantize apart / 300", 0x7690eefd9557f24f),
    ("qwen2moe / f32 / 8", 0xe306b8c37f3e3caa),
    ("qwen2moe / f32 / 300", 0x1964f1fc225ca8eb),
    ("qwen2moe / plain rows / 8", 0xcfc100012326f4e5),
    ("qwen2moe / plain rows / 300", 0xd56cd58bb95228f2),
    ("llama experts / default / 8", 0xbe850555b095034a),
    ("llama experts / default / 300", 0x88c920b71fedcbff),
    ("llama experts / quantize apart / 8", 0x1186ec82a3c1c85a),
    ("llama experts / quantize apart / 300", 0x487033d0bf0ae883),
    ("llama experts / f32 / 8", 0x28ad7e11767b54cc),
    ("llama experts / f32 / 300", 0x9c5cb2cecc1b7609),
    ("llama experts / plain rows / 8", 0x3f27d81f8ab05659),
    ("llama experts / plain rows / 300", 0xb4272d564101f7ce),
    ("qwen3next / default / 8", 0x931c794b7101edcb),
    ("qwen3next / default / 300", 0xa5d47761c68f8302),
    ("qwen3next / quantize apart / 8", 0x6843ee75dd7f63f5),
    ("qwen3next / quantize apart / 300", 0x441672c314ef6e60),
    ("qwen3next / f32 / 8", 0x13c508a59dc2e29a),
    ("qwen3next / f32 / 300", 0xde3181d55c2c8fc9),
    ("qwen3next / plain rows / 8", 0x728186efb1d06a8c),
    ("qwen3next / plain rows / 300", 0x156f0bb2d93388cb),
    ("qwen35 / default / 8", 0xcf7bc5294bb73fce),
    ("qwen35 / default / 300", 0x601f1dd44eeeb8d5),
    ("qwen35 / quantize apart / 8", 0x9b4b7143ba9b85a2),
    ("qwen35 / quantize apart / 300", 0x47aa766333e2f375),
    ("qwen35 / f32 / 8", 0xda7d7998519a1dc5),
    ("qwen35 / f32 / 300", 0x5efaed745b6e8e94),
    ("qwen35 / plain rows / 8", 0xa8003d1298b3c0f7),
    ("qwen35 / plain rows / 300", 0xe745eb978f6a0946),
    ("qwen35moe / default / 8", 0xe5c4487566e02216),
    ("qwen35moe / default / 300", 0x4168a94b4f45d217),
    ("qwen35moe / quantize apart / 8", 0x7407f16efa3018fc),
    ("qwen35moe / quantize apart / 300", 0xacf2cc08f1c5ad45),
    ("qwen35moe / f32 / 8", 0x0d5f71262ce1369b),
    ("qwen35moe / f32 / 300", 0x61c81dbb59ba98d0),
    ("qwen35moe / plain rows / 8", 0x65420507dbe6cf93),
    ("qwen35moe / plain rows / 300", 0x8c5c74d91d5d1a0c),
    ("qwen3next split / default / 8", 0x636821073fa8099a),
    ("qwen3next split / default / 300", 0x063c2c1243228d3f),
    ("qwen3next split / quantize apart / 8", 0x09b91197f3daff5c),
    ("qwen3next split / quantize apart / 300", 0x02489ea1a0d77a3d),
    ("qwen3next split / f32 / 8", 0xfc9efd25dade516e),
    ("qwen3next split / f32 / 300", 0x4a4f991c9ff2b5df),
    ("qwen3next split / plain rows / 8", 0xd31d89ad5b01244c),
    ("qwen3next split / plain rows / 300", 0x038d473b0598ebc5),
    ("llama YaRN / default / 8", 0x883fdc28b4c21af5),
    ("llama YaRN / default / 300", 0xac52067aea13b5b6),
    ("llama YaRN / quantize apart / 8", 0x832b0b518c087f0f),
    ("llama YaRN / quantize apart / 300", 0x44aad324f37d904c),
    ("llama YaRN / f32 / 8", 0xf7b01ec2d3ac4701),
    ("llama YaRN / f32 / 300", 0x137e6d5085d89ce6),
    ("llama YaRN / plain rows / 8", 0x7ed57d9dd8e0abc2),
    ("llama YaRN / plain rows / 300", 0xa5dfa333ef0f91c3),
    (
        "llama Q4_K, frequency factors, tied / default / 8",
        0xac697747f5a86ab7,
    ),
    (
        "llama Q4_K, frequency factors, tied / default / 300",
        0xaba27459c414afa4,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 8",
        0xc73f93be978b3ce7,
    ),
    (
        "llama Q4_K, frequency factors, tied / quantize apart / 300",
        0xb11830562b99c270,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 8",
        0x68a9ee9a4f001b4d,
    ),
    (
        "llama Q4_K, frequency factors, tied / f32 / 300",
        0x9e0591f745fb66fe,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 8",
        0x6c2a412979a08384,
    ),
    (
        "llama Q4_K, frequency factors, tied / plain rows / 300",
        0x721c3bd289d08fc7,
    ),
    ("llama Q4_0 / default / 8", 0x973422862830855b),
    ("llama Q4_0 / default / 300", 0xf71659ea47edff34),
    ("llama Q4_0 / quantize apart / 8", 0xdc556d90673bb3db),
    ("llama Q4_0 / quantize apart / 300", 0xf0490c97b594cb88),
    ("llama Q4_0 / f32 / 8", 0x0b4c5a729a75e412),
    ("llama Q4_0 / f32 / 300", 0x4b1af3fb7350b18f),
    ("llama Q4_0 / plain rows / 8", 0xe05d6db383e99acf),
    ("llama Q4_0 / plain rows / 300", 0x17597e22dfcce7c4),
    ("llama mixed types / default / 8", 0x34087695c3ed2898),
    ("llama mixed types / default / 300", 0x246ef294788b3b97),
    ("llama mixed types / quantize apart / 8", 0xef98e66d7125ac3c),
    (
        "llama mixed types / quantize apart / 300",
        0x921e1585a64171db,
    ),
    ("llama mixed types / f32 / 8", 0xa5474c101ca8817b),
    ("llama mixed types / f32 / 300", 0x76ac3df1102bebd2),
    ("llama mixed types / plain rows / 8", 0x1c45570e08b28e24),
    ("llama mixed types / plain rows / 300", 0x5bbf76ed06c7d4eb),
    ("dots1 / default / 8", 0xd342cf89abbf07a2),
    ("dots1 / default / 300", 0x2b87d255b8adbc1d),
    ("dots1 / quantize apart / 8", 0xdd01ee43c6af103e),
    ("dots1 / quantize apart / 300", 0xac94612b56b7af7d),
    ("dots1 / f32 / 8", 0xffa877da05415c8f),
    ("dots1 / f32 / 300", 0x53be170193c523e6),
    ("dots1 / plain rows / 8", 0x36d6a93e0f21a67d),
    ("dots1 / plain rows / 300", 0x16ea4b35b8d72f78),
    ("gpt-oss / default / 8", 0x0b1b5157d158a085),
    ("gpt-oss / default / 300", 0xe9b352fe23ed4ad6),
    ("gpt-oss / quantize apart / 8", 0x846401345017b5d9),
    ("gpt-oss / quantize apart / 300", 0xb5f88b4687168356),
    ("gpt-oss / f32 / 8", 0x775446cbd0ca454b),
    ("gpt-oss / f32 / 300", 0x197a9dab02114828),
    ("gpt-oss / plain rows / 8", 0xb162ccc8252b24a0),
    ("gpt-oss / plain rows / 300", 0xec8b54564e4ae2b5),
    ("llama 4 layers / default / 8", 0x98425abdccbbb7e7),
    ("llama 4 layers / default / 300", 0x34ceea74a6803470),
    ("llama 4 layers / quantize apart / 8", 0xf441e3c8ee21b929),
    ("llama 4 layers / quantize apart / 300", 0x3dc3283428f74b26),
    ("llama 4 layers / f32 / 8", 0x392dcfa24452e993),
    ("llama 4 layers / f32 / 300", 0x00ed082687704c00),
    ("llama 4 layers / plain rows / 8", 0x6dc81bf89412bae0),
    ("llama 4 layers / plain rows / 300", 0x183546dbcb324819),
    ("llama 4 layers / first 1", 0xf18e357371bae079),
    ("llama 4 layers / first 2", 0x7e5a65e187336187),
    ("llama tied false / rank 0 of 2", 0x05d173eb110a1986),
    ("llama tied false / rank 1 of 2", 0xde676e11c25ab538),
    ("llama tied false / rank 0 of 4", 0xdf79c2cf256622d7),
    ("llama tied false / rank 1 of 4", 0x37e2373c884d167e),
    ("llama tied false / rank 2 of 4", 0x2b121e6b85d41446),
    ("llama tied false / rank 3 of 4", 0x6d68b03f0aba714d),
    ("llama tied true / rank 0 of 2", 0x03f7b887eddfda25),
    ("llama tied true / rank 1 of 2", 0x93c7f1fc68964ce4),
    ("llama tied true / rank 0 of 4", 0x9ce37b5d57899133),
    ("llama tied true / rank 1 of 4", 0x455f9db2d9dfe08c),
    ("llama tied true / rank 2 of 4", 0xe0e8952b0ef240f3),
    ("llama tied true / rank 3 of 4", 0xa781ca552ade2c83),
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
