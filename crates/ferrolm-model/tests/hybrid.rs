//! Hybrid recurrent models (qwen3next): the plan a file gives, the refusals of files whose
//! `ssm.*` keys and tensors disagree, and the recurrent state's life in a session (carried
//! across calls, cleared on reuse, never rewound to a middle position).

use std::sync::Arc;

use ferrolm_gguf::{GgufFile, GgufWriter, Value};
use ferrolm_model::plan::Mixer;
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model, ModelError};

fn small() -> Vec<u8> {
    synthetic::build(&SyntheticSpec::small("qwen3next"))
        .unwrap()
        .to_bytes()
}

fn load(bytes: Vec<u8>) -> Result<Model, ModelError> {
    Model::from_file(Arc::new(GgufFile::from_bytes(bytes).unwrap()), 1)
}

/// The file in `bytes` with `keys` set and the tensors named in `drop` left out.
fn edited(bytes: Vec<u8>, keys: &[(&str, Value)], drop: &[&str]) -> Vec<u8> {
    let file = GgufFile::from_bytes(bytes).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().iter() {
        w.set(k, v.clone());
    }
    for (k, v) in keys {
        w.set(*k, v.clone());
    }
    for t in file.tensors() {
        if !drop.contains(&t.name.as_str()) {
            let data = file.tensor_data(t).to_vec();
            w.add_tensor(t.name.clone(), &t.dims, t.ty, data).unwrap();
        }
    }
    w.to_bytes()
}

fn error_of(bytes: Vec<u8>) -> String {
    match load(bytes) {
        Ok(_) => panic!("the file was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_plan_has_three_delta_net_layers_then_gated_attention() {
    let model = load(small()).unwrap();
    let plan = model.plan();
    let kinds: Vec<bool> = plan
        .layers
        .iter()
        .map(|l| matches!(l.mixer, Mixer::GatedDeltaNet(_)))
        .collect();
    assert_eq!(kinds, [true, true, true, false]);
    let Mixer::GatedDeltaNet(net) = plan.layers[0].mixer else {
        unreachable!()
    };
    assert_eq!(
        (net.n_k_heads, net.n_v_heads, net.head_dim, net.conv_kernel),
        (4, 8, 32, 4)
    );
    let a = &plan.layers[3].attention;
    assert!(a.gated_output && a.qk_norm);
    assert_eq!((a.rope.n_dims, a.head_dim), (16, 64), "partial rotary");
    // A llama-only fast path declines by name.
    assert_eq!(plan.beyond_llama(), Some("gated delta-net layer"));
    let mut attention_only = plan.clone();
    for l in &mut attention_only.layers {
        l.mixer = Mixer::Attention;
    }
    assert_eq!(
        attention_only.beyond_llama(),
        Some("gated attention output")
    );
}

#[test]
fn full_attention_interval_and_recurrent_layers_decide_the_schedule() {
    // Every other layer attention: layer 1 has no attention tensors, so the file is refused
    // naming one of them.
    let e = error_of(edited(
        small(),
        &[("qwen3next.full_attention_interval", Value::U32(2))],
        &[],
    ));
    assert!(e.contains("blk.1.attn_q.weight"), "{e}");
    let flags = Value::Array(ferrolm_gguf::Array::Bool(vec![true, true, true, false]));
    let with_flags = edited(
        small(),
        &[("qwen3next.attention.recurrent_layers", flags)],
        &[],
    );
    assert!(load(with_flags).is_ok());
    let short = Value::Array(ferrolm_gguf::Array::Bool(vec![true, false]));
    let e = error_of(edited(
        small(),
        &[("qwen3next.attention.recurrent_layers", short)],
        &[],
    ));
    assert!(
        e.contains("recurrent_layers has 2 entries for 4 layers"),
        "{e}"
    );
}

#[test]
fn keys_that_disagree_with_the_tensors_are_refused_by_name() {
    let cases: [(&str, u32, &[&str]); 4] = [
        (
            "qwen3next.ssm.conv_kernel",
            3,
            &["ssm.conv_kernel", "blk.0.ssm_conv1d.weight"],
        ),
        ("qwen3next.ssm.state_size", 16, &["ssm.inner_size 256"]),
        (
            "qwen3next.ssm.time_step_rank",
            6,
            &["not a multiple of ssm.group_count 4"],
        ),
        ("qwen3next.ssm.inner_size", 512, &["ssm.inner_size 512"]),
    ];
    for (key, value, needles) in cases {
        let e = error_of(edited(small(), &[(key, Value::U32(value))], &[]));
        for n in needles {
            assert!(e.contains(n), "{key} = {value}: {e}");
        }
    }
    // State size and heads changed together (consistent keys) disagree with ssm_in's shape.
    let e = error_of(edited(
        small(),
        &[
            ("qwen3next.ssm.state_size", Value::U32(16)),
            ("qwen3next.ssm.inner_size", Value::U32(128)),
        ],
        &[],
    ));
    assert!(
        e.contains("blk.0.ssm_in.weight") && e.contains("ssm.state_size"),
        "{e}"
    );
    let e = error_of(edited(
        small(),
        &[("qwen3next.ssm.conv_kernel", Value::U32(0))],
        &[],
    ));
    assert!(e.contains("must all be above 0"), "{e}");
}

#[test]
fn a_missing_ssm_tensor_is_named() {
    for name in [
        "blk.0.ssm_a",
        "blk.1.ssm_dt.bias",
        "blk.2.ssm_conv1d.weight",
        "blk.0.ssm_ba.weight",
        "blk.1.ssm_norm.weight",
        "blk.2.ssm_out.weight",
        "blk.0.ssm_in.weight",
    ] {
        let e = error_of(edited(small(), &[], &[name]));
        assert!(e.contains(name) && e.contains("missing"), "{name}: {e}");
    }
    // And a missing key is named too.
    let bytes = small();
    let file = GgufFile::from_bytes(bytes.clone()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().iter() {
        if k != "qwen3next.ssm.group_count" {
            w.set(k, v.clone());
        }
    }
    for t in file.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, file.tensor_data(t).to_vec())
            .unwrap();
    }
    let e = error_of(w.to_bytes());
    assert!(e.contains("qwen3next.ssm.group_count"), "{e}");
}

#[test]
fn qwen3next_without_experts_is_refused_as_llama_cpp_does() {
    let mut spec = SyntheticSpec::small("qwen3next");
    spec.n_expert = 0;
    spec.n_ff_shexp = 0;
    let e = error_of(synthetic::build(&spec).unwrap().to_bytes());
    assert!(e.contains("expert_count must be above 0"), "{e}");
}

/// A few pseudo-random ids of the small vocabulary.
fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % 900)
        .collect()
}

#[test]
fn the_state_is_carried_across_calls_and_cleared_on_reuse() {
    let model = load(small()).unwrap();
    let n_vocab = model.plan().n_vocab;
    let prompt = ids(100, 1);
    let mut whole = model.session(512);
    let all = whole.eval(&prompt, Logits::All).unwrap();
    // The same prompt in two calls (the second starting past a chunk boundary) continues
    // the state: the same logits.
    let mut split = model.session(512);
    let mut parts = split.eval(&prompt[..64], Logits::All).unwrap();
    parts.extend(split.eval(&prompt[64..], Logits::All).unwrap());
    assert_eq!(parts, all);
    // Decoding token by token after the prompt goes on from the same state.
    let next = whole.eval(&[5], Logits::Last).unwrap();
    assert_eq!(split.eval(&[5], Logits::Last).unwrap(), next);

    // Reusing a session from position 0 starts from a clean state: the same as a new one.
    let other = ids(40, 2);
    let fresh = model.session(512).eval(&other, Logits::All).unwrap();
    whole.reset();
    assert_eq!(whole.eval(&other, Logits::All).unwrap(), fresh);
    // Truncating to 0 is a reset too.
    split.truncate(0);
    assert_eq!(split.position(), 0);
    assert_eq!(split.eval(&other, Logits::All).unwrap(), fresh);

    // A recurrent state cannot go back to a middle position: the session starts over (the
    // caller evaluates from 0 again), and keeping the current position keeps everything.
    split.truncate(40);
    assert_eq!(split.position(), 40);
    split.truncate(20);
    assert_eq!(split.position(), 0, "no rewind into a recurrent state");
    let again = split.eval(&other, Logits::All).unwrap();
    assert_eq!(again, fresh);
    assert_eq!(fresh.len(), other.len() * n_vocab);
}

#[test]
fn batched_sequences_keep_their_own_states_and_a_reused_slot_starts_clean() {
    let model = load(small()).unwrap();
    let (a, b) = (ids(30, 3), ids(50, 4));
    let alone_a = model.session(256).eval(&a, Logits::Last).unwrap();
    let alone_b = model.session(256).eval(&b, Logits::Last).unwrap();
    let mut s1 = model.session(256);
    let mut s2 = model.session(256);
    // Slot 2 first holds another sequence, then is cleared for b (the server's reuse).
    s2.eval(&ids(70, 5), Logits::None).unwrap();
    s2.reset();
    let out = model.eval_many(&mut [
        (&mut s1, a.as_slice(), Logits::Last),
        (&mut s2, b.as_slice(), Logits::Last),
    ]);
    let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(x, y)| (x - y).abs() < 1e-3);
    assert!(close(out[0].as_ref().unwrap(), &alone_a));
    assert!(close(out[1].as_ref().unwrap(), &alone_b));
    // One decode step each, batched, goes on from each one's own state.
    let mut ref_a = model.session(256);
    ref_a.eval(&a, Logits::None).unwrap();
    let want_a = ref_a.eval(&[7], Logits::Last).unwrap();
    let out = model.eval_many(&mut [
        (&mut s1, &[7][..], Logits::Last),
        (&mut s2, &[9][..], Logits::Last),
    ]);
    assert!(close(out[0].as_ref().unwrap(), &want_a));
}

fn small_qwen35() -> Vec<u8> {
    synthetic::build(&SyntheticSpec::small("qwen35"))
        .unwrap()
        .to_bytes()
}

#[test]
fn qwen35_is_dense_with_tiled_key_heads_and_its_refusals_name_the_cause() {
    let model = load(small_qwen35()).unwrap();
    let plan = model.plan();
    let Mixer::GatedDeltaNet(net) = plan.layers[0].mixer else {
        unreachable!()
    };
    assert_eq!(net.key_heads, ferrolm_model::plan::KeyHeads::Tiled);
    assert!(matches!(
        plan.layers[3].ffn,
        ferrolm_model::plan::Ffn::Gated { n_ff: 512, .. }
    ));
    // Sections that leave rotated pairs to the fourth (non-rotating for text) section.
    let sections = Value::Array(ferrolm_gguf::Array::I32(vec![1, 1, 1, 5]));
    let e = error_of(edited(
        small_qwen35(),
        &[("qwen35.rope.dimension_sections", sections)],
        &[],
    ));
    assert!(e.contains("rope.dimension_sections"), "{e}");
    for name in [
        "blk.0.ssm_beta.weight",
        "blk.2.ssm_alpha.weight",
        "blk.1.attn_gate.weight",
    ] {
        let e = error_of(edited(small_qwen35(), &[], &[name]));
        assert!(e.contains(name) && e.contains("missing"), "{name}: {e}");
    }
}

/// A chat's next turn goes back into the last reply: the session resumes from the states it
/// kept at the end of the prompt (not from 0), and what follows is computed as the first time.
#[test]
fn going_back_into_a_reply_resumes_from_the_end_of_the_prompt() {
    let model = load(small()).unwrap();
    let prompt = ids(60, 3);
    let reply = [7u32, 11, 13, 17];
    let mut s = model.session(512);
    s.eval(&prompt, Logits::Last).unwrap();
    let first: Vec<Vec<f32>> = reply
        .iter()
        .map(|&id| s.eval(&[id], Logits::Last).unwrap())
        .collect();
    assert_eq!(s.position(), 64);
    // Back to position 62, inside the reply: the checkpoint at 60 is the nearest exact state.
    s.truncate(62);
    assert_eq!(s.position(), 60);
    for (&id, want) in reply.iter().zip(&first) {
        assert_eq!(&s.eval(&[id], Logits::Last).unwrap(), want);
    }
    // Back before the prompt's end: no exact state there, the session starts over.
    s.truncate(30);
    assert_eq!(s.position(), 0);
    // A new prompt moves the checkpoint; an earlier one is gone with the reset.
    let other = ids(20, 4);
    s.eval(&other, Logits::Last).unwrap();
    s.eval(&[5], Logits::Last).unwrap();
    s.truncate(20);
    assert_eq!(s.position(), 20);
    s.truncate(10);
    assert_eq!(s.position(), 0);
}
