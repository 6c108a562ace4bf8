//! Refusals (DESIGN.md principle 2): a layer-plan feature that a llama-only fast path does not
//! serve makes it decline by name; an unknown architecture is an error listing the known ones.

use std::sync::Arc;

use ferrolm_gguf::{GgufFile, Value};
use ferrolm_model::plan::Activation;
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Model, ModelError, ModelPlan};

fn plan_of(arch: &str) -> ModelPlan {
    let mut spec = SyntheticSpec::small(arch);
    spec.n_layer = spec.n_layer.min(6);
    let bytes = synthetic::build(&spec).unwrap().to_bytes();
    let model = Model::from_file(Arc::new(GgufFile::from_bytes(bytes).unwrap()), 1).unwrap();
    model.plan().clone()
}

#[test]
fn llama_plans_are_served_and_each_added_feature_declines() {
    for arch in ["llama", "mistral", "qwen2", "qwen3"] {
        assert_eq!(plan_of(arch).beyond_llama(), None, "{arch}");
    }
    let base = plan_of("llama");
    type Edit = fn(&mut ModelPlan);
    let edits: [(&str, Edit); 12] = [
        ("queries scaled before the product", |p| {
            p.layers[1].attention.scale_queries = true
        }),
        ("attention logit soft-cap", |p| {
            p.layers[0].attention.softcap = Some(50.0)
        }),
        ("sliding-window attention", |p| {
            p.layers[2].attention.sliding_window = Some(64)
        }),
        ("LongRoPE frequency factors", |p| {
            p.layers[1].attention.rope.long_rope = Some(ferrolm_model::plan::LongRope {
                original_context: 4096,
            })
        }),
        ("RoPE attention factor", |p| {
            p.layers[0].attention.rope.attn_factor = 1.19
        }),
        ("an activation other than SiLU", |p| {
            p.layers[0].ffn = ferrolm_model::plan::Ffn::Gated {
                n_ff: 512,
                activation: Activation::GeluTanh,
            }
        }),
        ("post-attention norm", |p| {
            p.layers[3].post_attention_norm = true
        }),
        ("post-feed-forward norm", |p| {
            p.layers[0].post_ffn_norm = true
        }),
        ("residual scale", |p| p.layers[0].residual_scale = Some(0.5)),
        ("embedding scale", |p| p.embedding_scale = Some(16.0)),
        ("final logit soft-cap", |p| {
            p.final_logit_softcap = Some(30.0)
        }),
        ("logit scale", |p| p.logit_scale = Some(8.0)),
    ];
    for (what, edit) in edits {
        let mut p = base.clone();
        edit(&mut p);
        assert_eq!(p.beyond_llama(), Some(what));
    }
}

#[test]
fn gemma_and_granite_plans_carry_their_features() {
    let g3 = plan_of("gemma3");
    assert!(g3.beyond_llama().is_some());
    let windows: Vec<_> = g3
        .layers
        .iter()
        .map(|l| l.attention.sliding_window)
        .collect();
    assert_eq!(
        windows,
        [Some(64), Some(64), Some(64), Some(64), Some(64), None]
    );
    assert_eq!(g3.layers[0].attention.rope.freq_base, 10_000.0);
    assert_eq!(g3.layers[5].attention.rope.freq_base, 1_000_000.0);
    assert_eq!(g3.embedding_scale, Some(16.0));
    let g2 = plan_of("gemma2");
    assert_eq!(g2.layers[0].attention.softcap, Some(4.0));
    assert_eq!(g2.final_logit_softcap, Some(3.0));
    assert_eq!(g2.layers[1].attention.sliding_window, None);
    let gr = plan_of("granite");
    assert_eq!(gr.logit_scale, Some(0.75));
    assert_eq!(gr.layers[0].residual_scale, Some(0.5));
    assert_eq!(gr.beyond_llama(), Some("residual scale"));
}

#[test]
fn an_unknown_architecture_is_an_error_listing_the_known_ones() {
    let mut w = synthetic::build(&SyntheticSpec::small("llama")).unwrap();
    w.set("general.architecture", Value::String("phi9".into()));
    let file = Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap());
    let err = Model::from_file(file, 1).err().expect("refused");
    assert!(matches!(err, ModelError::UnknownArchitecture(..)));
    let msg = err.to_string();
    for known in [
        "phi9", "llama", "qwen3", "gemma2", "gemma3", "granite", "phi3",
    ] {
        assert!(msg.contains(known), "{msg}");
    }
}

/// Phi-3 LongRoPE: both sets of factors make a plan field (the context length the choice
/// turns on, the attention factor); one set alone is refused by name.
#[test]
fn phi3_longrope_is_a_plan_field_and_half_of_it_is_refused() {
    let plan = plan_of("phi3");
    assert_eq!(plan.layers[0].attention.rope.n_dims, 24, "partial rotary");
    assert!(plan.layers[0].attention.scale_queries);
    assert_eq!(plan.layers[0].attention.rope.long_rope, None);
    let mut spec = SyntheticSpec::small("phi3");
    spec.n_ctx = 8192;
    spec.long_rope = Some(1024);
    let bytes = synthetic::build(&spec).unwrap().to_bytes();
    let model =
        Model::from_file(Arc::new(GgufFile::from_bytes(bytes.clone()).unwrap()), 1).unwrap();
    let rope = &model.plan().layers[3].attention.rope;
    assert_eq!(
        rope.long_rope,
        Some(ferrolm_model::plan::LongRope {
            original_context: 1024
        })
    );
    assert_eq!(rope.attn_factor, 1.3f32.sqrt());

    // The file without its short factors.
    let file = GgufFile::from_bytes(bytes).unwrap();
    let mut w = ferrolm_gguf::GgufWriter::new();
    for (k, v) in file.metadata().iter() {
        w.set(k, v.clone());
    }
    for t in file.tensors() {
        if t.name != "rope_factors_short.weight" {
            w.add_tensor(t.name.clone(), &t.dims, t.ty, file.tensor_data(t).to_vec())
                .unwrap();
        }
    }
    let err = Model::from_file(Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap()), 1)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("rope_factors_short"), "{err}");
}

/// The sliding-window layers' cache is a ring of `window + 512` cells rounded to 256, whatever
/// the context: for synthetic gemma3 (five of six layers sliding, window 64), 768 cells.
#[test]
fn sliding_window_layers_keep_a_ring() {
    let plan = plan_of("gemma3");
    let kv_bytes = |cells: usize| {
        let a = &plan.layers[0].attention;
        cells * a.n_head_kv * a.head_dim * 2 * 2
    };
    for n_ctx in [1024, 32768] {
        let cache = ferrolm_model::KvCache::new(&plan, n_ctx);
        assert_eq!(
            cache.bytes(),
            5 * kv_bytes(768) + kv_bytes(n_ctx),
            "n_ctx {n_ctx}"
        );
    }
    // Shorter than the ring: every layer holds the context.
    let cache = ferrolm_model::KvCache::new(&plan, 300);
    assert_eq!(cache.bytes(), 6 * kv_bytes(512));
}

/// Going back within the ring is exact (the same logits as evaluating the kept prefix afresh);
/// going back past what the ring keeps starts over at 0 instead of reading overwritten cells.
#[test]
fn rewinding_a_ring_is_exact_or_starts_over() {
    let bytes = synthetic::build(&SyntheticSpec::small("gemma3"))
        .unwrap()
        .to_bytes();
    let model = Model::from_file(Arc::new(GgufFile::from_bytes(bytes).unwrap()), 1).unwrap();
    let n_vocab = model.plan().n_vocab as u64;
    let ids: Vec<u32> = (0..1000u64)
        .map(|i| ((i * 7919 + 13) % n_vocab) as u32)
        .collect();
    let last = ferrolm_model::Logits::Last;
    let mut a = model.session(2048);
    a.eval(&ids, ferrolm_model::Logits::None).unwrap();
    a.truncate(900);
    assert_eq!(a.position(), 900);
    let la = a.eval(&ids[900..901], last).unwrap();
    let mut b = model.session(2048);
    b.eval(&ids[..900], ferrolm_model::Logits::None).unwrap();
    let lb = b.eval(&ids[900..901], last).unwrap();
    assert!(la == lb, "rewound ring differs from a fresh prefix");
    // 1000 written, ring of 768 cells, window 64: position 100 needs keys 37..100, long gone.
    a.eval(&ids[901..1000], ferrolm_model::Logits::None)
        .unwrap();
    a.truncate(100);
    assert_eq!(a.position(), 0);
}

/// Mixtures of experts: the plan carries the router's shape and rules, a llama-only fast path
/// declines them by name, and files whose experts do not match their metadata are refused
/// with an error naming what is wrong.
#[test]
fn moe_plans_carry_their_experts_and_bad_files_are_refused() {
    use ferrolm_model::plan::{Ffn, Gating, Moe};
    let q = plan_of("qwen3moe");
    let moe = Moe {
        n_expert: 8,
        n_expert_used: 2,
        n_ff: 256,
        activation: Activation::Silu,
        gating: Gating::Softmax,
        selection_bias: false,
        groups: None,
        biases: false,
        norm_weights: true,
        weights_scale: None,
        shared: None,
    };
    assert!(q.layers.iter().all(|l| l.ffn == Ffn::Moe(moe.clone())));
    assert!(q.layers[0].attention.qk_norm);
    assert_eq!(q.beyond_llama(), Some("mixture-of-experts feed-forward"));
    let mut p = plan_of("llama");
    p.layers[2].ffn = Ffn::Moe(moe);
    assert_eq!(p.beyond_llama(), Some("mixture-of-experts feed-forward"));

    let refused = |arch: &str, edit: &dyn Fn(&mut SyntheticSpec, &mut ferrolm_gguf::GgufWriter)| {
        let mut spec = SyntheticSpec::small(arch);
        spec.n_layer = 2;
        if arch == "llama" {
            spec.n_expert = 4;
            spec.n_expert_used = 2;
        }
        let mut w = synthetic::build(&spec).unwrap();
        edit(&mut spec, &mut w);
        let file = Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap());
        Model::from_file(file, 1)
            .err()
            .expect("refused")
            .to_string()
    };
    // More experts used than there are.
    let e = refused("qwen3moe", &|_, w| {
        w.set("qwen3moe.expert_used_count", Value::U32(9));
    });
    assert!(e.contains("expert_used_count") && e.contains('9'), "{e}");
    // An expert count the tensors do not have.
    let e = refused("llama", &|_, w| {
        w.set("llama.expert_count", Value::U32(6));
    });
    assert!(e.contains("ffn_gate_inp"), "{e}");
    // qwen3moe without experts.
    let e = refused("qwen3moe", &|_, w| {
        w.set("qwen3moe.expert_count", Value::U32(0));
    });
    assert!(e.contains("expert_count"), "{e}");
    // Experts where the architecture has none.
    let e = refused("qwen3", &|_, w| {
        w.set("qwen3.expert_count", Value::U32(4));
    });
    assert!(
        e.contains("mixture-of-experts") && e.contains("qwen3"),
        "{e}"
    );
    // Shared experts are not served yet.
    let e = refused("llama", &|_, w| {
        w.set("llama.expert_shared_feed_forward_length", Value::U32(128));
    });
    assert!(e.contains("shared experts"), "{e}");
}

/// Expert activation counts: each token adds one per selected expert in every MoE layer.
#[test]
fn expert_counts_add_up_to_tokens_times_top_k() {
    let bytes = synthetic::build(&SyntheticSpec::small("qwen3moe"))
        .unwrap()
        .to_bytes();
    let model = Model::from_file(Arc::new(GgufFile::from_bytes(bytes).unwrap()), 1).unwrap();
    assert!(model
        .expert_counts()
        .iter()
        .all(|l| l.iter().all(|&c| c == 0)));
    let mut s = model.session(256);
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 900).collect();
    s.eval(&ids, ferrolm_model::Logits::Last).unwrap();
    s.eval(&[7], ferrolm_model::Logits::Last).unwrap();
    let counts = model.expert_counts();
    assert_eq!(counts.len(), 4);
    for layer in &counts {
        assert_eq!(layer.len(), 8);
        assert_eq!(layer.iter().sum::<u64>(), 41 * 2);
    }
    // Dense models count nothing.
    let dense = plan_of("qwen3");
    assert!(dense
        .layers
        .iter()
        .all(|l| matches!(l.ffn, ferrolm_model::plan::Ffn::Gated { .. })));
}

/// Qwen2-MoE: routed weights not renormalized, a sigmoid-gated shared expert of
/// `expert_shared_feed_forward_length`; a file without `output.weight` (which llama.cpp's
/// qwen2moe requires) is refused by name.
#[test]
fn qwen2moe_plans_a_gated_shared_expert_and_requires_an_output_matrix() {
    use ferrolm_model::plan::{Ffn, SharedExpert};
    let p = plan_of("qwen2moe");
    for l in &p.layers {
        let Ffn::Moe(m) = &l.ffn else {
            panic!("dense layer in qwen2moe")
        };
        assert!(!m.norm_weights);
        assert_eq!(
            m.shared,
            Some(SharedExpert {
                n_ff: 384,
                gated: true
            })
        );
        assert!(l.attention.qkv_bias);
    }
    assert!(!p.tied_output);
    let mut spec = SyntheticSpec::small("qwen2moe");
    spec.n_layer = 2;
    spec.tied_output = true;
    let bytes = synthetic::build(&spec).unwrap().to_bytes();
    let file = Arc::new(GgufFile::from_bytes(bytes).unwrap());
    let e = Model::from_file(file, 1)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("output.weight"), "{e}");
}

/// llama-family files may carry Q/K/V and attention-output biases (llama.cpp applies them):
/// they are read into the plan; a layer lacking one, or a feed-forward bias (which the plan has
/// no place for), is an error naming the tensor rather than a silently different model.
#[test]
fn llama_attention_biases_are_read_and_partial_or_ffn_biases_refused() {
    let mut spec = SyntheticSpec::small("llama");
    spec.n_layer = 2;
    spec.attention_biases = true;
    let load = |w: &ferrolm_gguf::GgufWriter| {
        Model::from_file(Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap()), 1)
    };
    let w = synthetic::build(&spec).unwrap();
    let model = load(&w).unwrap();
    assert!(model
        .plan()
        .layers
        .iter()
        .all(|l| l.attention.qkv_bias && l.attention.out_bias));
    assert!(model.plan().beyond_llama().is_some());

    let mut partial = synthetic::build(&spec).unwrap();
    assert!(partial.remove_tensor("blk.1.attn_k.bias"));
    let e = load(&partial).err().expect("refused").to_string();
    assert!(e.contains("blk.1.attn_k.bias"), "{e}");

    let mut ffn = synthetic::build(&spec).unwrap();
    let n_ff = spec.n_ff as u64;
    ffn.add_tensor(
        "blk.1.ffn_up.bias",
        &[n_ff],
        ferrolm_gguf::TensorType::F32,
        vec![0; 4 * spec.n_ff],
    )
    .unwrap();
    let e = load(&ffn).err().expect("refused").to_string();
    assert!(e.contains("blk.1.ffn_up.bias") && e.contains("bias"), "{e}");
}

#[test]
fn zero_sizes_are_refused_at_load_naming_the_key() {
    for (key, value, want) in [
        (
            "llama.attention.key_length",
            0u32,
            "llama.attention.key_length",
        ),
        ("llama.feed_forward_length", 0, "llama.feed_forward_length"),
        ("llama.embedding_length", 0, "llama.embedding_length"),
        ("llama.vocab_size", 0, "llama.vocab_size"),
        ("llama.context_length", 0, "llama.context_length"),
    ] {
        let spec = SyntheticSpec::small("llama");
        let mut w = synthetic::build(&spec).unwrap();
        w.set(key, Value::U32(value));
        let file = Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap());
        let e = Model::from_file(file, 1).err().expect(key).to_string();
        assert!(e.contains(want), "{key}: {e}");
    }
}
