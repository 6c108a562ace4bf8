//! Bad mixture-of-experts files (issue 8, item 6): each is refused with an error naming what is
//! wrong, never a panic: an expert count or top-k that does not match the tensors, a router of
//! the wrong shape, an unknown gating function, a shared-expert gate of the wrong shape,
//! expert groups that do not split the experts, a selection bias or expert bias of the wrong
//! shape. Plans of the routing variants carry what llama.cpp's graph does.

use std::sync::Arc;

use ferrolm_gguf::{GgufFile, GgufWriter, TensorType, Value};
use ferrolm_model::plan::{Activation, ExpertGroups, Ffn, Gating, SharedExpert};
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Model, ModelPlan};

fn spec(arch: &str) -> SyntheticSpec {
    let mut spec = SyntheticSpec::small(arch);
    spec.n_layer = 2;
    spec
}

fn load(w: &GgufWriter) -> ferrolm_model::Result<Model> {
    let file = Arc::new(GgufFile::from_bytes(w.to_bytes()).unwrap());
    Model::from_file(file, 1)
}

fn plan_of(arch: &str) -> ModelPlan {
    load(&synthetic::build(&spec(arch)).unwrap())
        .unwrap()
        .plan()
        .clone()
}

/// The error `arch`'s small file gives once `edit` has broken it.
fn refused(arch: &str, edit: &dyn Fn(&SyntheticSpec, &mut GgufWriter)) -> String {
    let spec = spec(arch);
    let mut w = synthetic::build(&spec).unwrap();
    edit(&spec, &mut w);
    match load(&w) {
        Ok(_) => panic!("{arch}: the broken file was accepted"),
        Err(e) => e.to_string(),
    }
}

/// Replaces `name` with an F32 tensor of `dims` (GGML order).
fn replace(w: &mut GgufWriter, name: &str, dims: &[u64]) {
    assert!(w.remove_tensor(name), "{name} is not in the file");
    let n: u64 = dims.iter().product();
    w.add_tensor(name, dims, TensorType::F32, vec![0u8; 4 * n as usize])
        .unwrap();
}

#[test]
fn routing_variants_are_planned_as_llama_cpp_builds_them() {
    let dots = plan_of("dots1");
    assert!(matches!(dots.layers[0].ffn, Ffn::Gated { n_ff: 128, .. }));
    let Ffn::Moe(m) = &dots.layers[1].ffn else {
        panic!("dots1 layer 1 is dense")
    };
    assert_eq!(m.gating, Gating::Sigmoid);
    assert!(m.selection_bias && m.norm_weights && !m.biases);
    assert_eq!(m.weights_scale, Some(2.5));
    assert_eq!(
        m.groups,
        Some(ExpertGroups {
            n_group: 4,
            n_group_used: 2
        })
    );
    assert_eq!(
        m.shared,
        Some(SharedExpert {
            n_ff: 128,
            gated: false
        })
    );

    let oss = plan_of("gpt-oss");
    for (i, l) in oss.layers.iter().enumerate() {
        let Ffn::Moe(m) = &l.ffn else {
            panic!("gpt-oss layer {i} is dense")
        };
        assert_eq!(m.gating, Gating::SoftmaxAfterTopK);
        assert_eq!(m.activation, Activation::SwigluOai);
        assert!(m.biases && !m.norm_weights && m.shared.is_none());
        let a = &l.attention;
        assert!(a.sinks && a.out_bias && a.qkv_bias);
        // Even layers slide.
        assert_eq!(a.sliding_window, (i % 2 == 0).then_some(64));
        let y = a.rope.yarn.expect("YaRN");
        assert_eq!((y.n_ctx_orig, a.rope.freq_scale), (256, 0.25));
    }
    assert_eq!(oss.beyond_llama(), Some("mixture-of-experts feed-forward"));

    // Grouped top-k applies to any architecture's file with groups, as in llama.cpp.
    let mut w = synthetic::build(&spec("qwen3moe")).unwrap();
    w.set("qwen3moe.expert_group_count", Value::U32(4));
    w.set("qwen3moe.expert_group_used_count", Value::U32(2));
    let q = load(&w).unwrap();
    let Ffn::Moe(m) = &q.plan().layers[0].ffn else {
        panic!("qwen3moe layer 0 is dense")
    };
    assert_eq!(
        m.groups,
        Some(ExpertGroups {
            n_group: 4,
            n_group_used: 2
        })
    );
    assert_eq!(plan_of("qwen3moe").layers[0].ffn, {
        let mut plain = m.clone();
        plain.groups = None;
        Ffn::Moe(plain)
    });
}

#[test]
fn expert_counts_that_do_not_match_the_tensors_are_refused() {
    // More experts in the metadata than the tensors hold.
    let e = refused("dots1", &|_, w| {
        w.set("dots1.expert_count", Value::U32(32));
    });
    assert!(e.contains("ffn_gate_inp"), "{e}");
    // Fewer.
    let e = refused("gpt-oss", &|_, w| {
        w.set("gpt-oss.expert_count", Value::U32(6));
    });
    assert!(e.contains("ffn_gate_inp"), "{e}");
    // A top-k beyond the experts.
    let e = refused("gpt-oss", &|_, w| {
        w.set("gpt-oss.expert_used_count", Value::U32(9));
    });
    assert!(e.contains("expert_used_count") && e.contains('9'), "{e}");
    // No top-k at all.
    let e = refused("dots1", &|_, w| {
        w.set("dots1.expert_used_count", Value::U32(0));
    });
    assert!(e.contains("expert_used_count"), "{e}");
}

#[test]
fn a_router_of_the_wrong_shape_is_refused_by_name() {
    let e = refused("dots1", &|s, w| {
        replace(w, "blk.1.ffn_gate_inp.weight", &[s.n_embd as u64 / 2, 16]);
    });
    assert!(
        e.contains("blk.1.ffn_gate_inp.weight") && e.contains("shape"),
        "{e}"
    );
    let e = refused("gpt-oss", &|_, w| {
        replace(w, "blk.0.ffn_gate_inp.bias", &[7]);
    });
    assert!(e.contains("blk.0.ffn_gate_inp.bias"), "{e}");
    let e = refused("dots1", &|_, w| {
        replace(w, "blk.1.exp_probs_b.bias", &[15]);
    });
    assert!(e.contains("blk.1.exp_probs_b.bias"), "{e}");
    let e = refused("gpt-oss", &|s, w| {
        replace(w, "blk.1.ffn_down_exps.bias", &[s.n_embd as u64, 7]);
    });
    assert!(e.contains("blk.1.ffn_down_exps.bias"), "{e}");
}

#[test]
fn unknown_or_missing_gating_functions_are_refused_naming_the_value() {
    let e = refused("dots1", &|_, w| {
        w.set("dots1.expert_gating_func", Value::U32(7));
    });
    assert!(e.contains("expert_gating_func") && e.contains('7'), "{e}");
    // 4 (sqrt of softplus) is llama.cpp's, but not run here yet: refused by value too.
    let e = refused("dots1", &|_, w| {
        w.set("dots1.expert_gating_func", Value::U32(4));
    });
    assert!(e.contains("4 in dots1.expert_gating_func"), "{e}");
    // llama.cpp has no default for dots1 (its graph aborts): a missing key is an error.
    let spec = spec("dots1");
    let e = match load(&rebuild_without(&spec, "dots1.expert_gating_func")) {
        Ok(_) => panic!("accepted without expert_gating_func"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("expert_gating_func is missing"), "{e}");
}

/// `spec`'s file without the metadata key `key`.
fn rebuild_without(spec: &SyntheticSpec, key: &str) -> GgufWriter {
    let full = synthetic::build(spec).unwrap();
    let file = GgufFile::from_bytes(full.to_bytes()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().iter() {
        if k != key && k != "general.alignment" {
            w.set(k, v.clone());
        }
    }
    for t in file.tensors() {
        w.add_tensor(&t.name, &t.dims, t.ty, file.tensor_data(t).to_vec())
            .unwrap();
    }
    w
}

#[test]
fn a_shared_expert_gate_of_the_wrong_shape_is_refused_by_name() {
    let e = refused("qwen2moe", &|s, w| {
        replace(w, "blk.0.ffn_gate_inp_shexp.weight", &[s.n_embd as u64, 2]);
    });
    assert!(
        e.contains("blk.0.ffn_gate_inp_shexp.weight") && e.contains("shape"),
        "{e}"
    );
    let e = refused("dots1", &|s, w| {
        replace(w, "blk.1.ffn_up_shexp.weight", &[s.n_embd as u64, 64]);
    });
    assert!(e.contains("blk.1.ffn_up_shexp.weight"), "{e}");
}

#[test]
fn expert_groups_that_do_not_split_the_experts_are_refused() {
    for (groups, used, why) in [
        (3, 2, "split the experts evenly"),
        (4, 4, "fewer than the groups"),
        (4, 0, "at least 1"),
        // One kept group of 2 experts cannot hold a top-4.
        (8, 1, "fewer experts than a token uses"),
    ] {
        let e = refused("dots1", &|_, w| {
            w.set("dots1.expert_group_count", Value::U32(groups));
            w.set("dots1.expert_group_used_count", Value::U32(used));
        });
        assert!(
            e.contains("expert_group_count") && e.contains(why),
            "{groups}/{used}: {e}"
        );
    }
}
