//! Several sequences in one forward pass give each the logits it gets alone.

use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model, ModelError};

fn model(arch: &str) -> Model {
    let spec = SyntheticSpec::small(arch);
    let bytes = synthetic::build(&spec).unwrap().to_bytes();
    Model::from_file(
        std::sync::Arc::new(ferrolm_gguf::GgufFile::from_bytes(bytes).unwrap()),
        2,
    )
    .unwrap()
}

#[test]
fn a_batch_of_sequences_equals_each_alone() {
    for arch in ["llama", "qwen3"] {
        let m = model(arch);
        let n_vocab = m.plan().n_vocab as u32;
        let prompt = |seed: u32, len: usize| -> Vec<u32> {
            (0..len as u32)
                .map(|i| (i * 7919 + seed * 104_729) % n_vocab)
                .collect()
        };
        // Alone: a prompt, then one decode step each.
        let prompts = [prompt(1, 5), prompt(2, 9), prompt(3, 1)];
        let next = [11u32, 22, 33];
        let mut alone = Vec::new();
        for (p, &t) in prompts.iter().zip(&next) {
            let mut s = m.session(64);
            let a = s.eval(p, Logits::Last).unwrap();
            let b = s.eval(&[t], Logits::Last).unwrap();
            alone.push((a, b));
        }
        // Together: the three prompts in one pass, then the three decode steps in one pass,
        // with a fourth sequence whose step fails (an id outside the vocabulary) among them.
        let mut sessions: Vec<_> = (0..4).map(|_| m.session(64)).collect();
        let bad = [n_vocab + 5];
        let (s0, rest) = sessions.split_at_mut(1);
        let (s1, rest) = rest.split_at_mut(1);
        let (s2, s3) = rest.split_at_mut(1);
        let mut items = vec![
            (&mut s0[0], &prompts[0][..], Logits::Last),
            (&mut s1[0], &prompts[1][..], Logits::Last),
            (&mut s3[0], &bad[..], Logits::Last),
            (&mut s2[0], &prompts[2][..], Logits::Last),
        ];
        let first = m.eval_many(&mut items);
        assert!(matches!(first[2], Err(ModelError::TokenOutOfRange { .. })));
        let mut items = vec![
            (&mut s0[0], &next[0..1], Logits::Last),
            (&mut s1[0], &next[1..2], Logits::Last),
            (&mut s2[0], &next[2..3], Logits::Last),
        ];
        let second = m.eval_many(&mut items);
        for (i, (a, b)) in alone.iter().enumerate() {
            let j = if i == 2 { 3 } else { i };
            let got_a = first[j].as_ref().unwrap();
            let got_b = second[i].as_ref().unwrap();
            // Bit for bit: the per-element arithmetic does not depend on the batch for these
            // block types (the synthetic files use the types whose batched path equals vec_dot,
            // except F16 attn_v, whose batched path is llama.cpp's tinyBLAS: compare closely).
            let close = |x: &[f32], y: &[f32]| {
                x.iter()
                    .zip(y)
                    .all(|(p, q)| (p - q).abs() <= 1e-3 * (1.0 + q.abs()))
            };
            assert!(
                close(got_a, a),
                "{arch}: sequence {i}, prompt logits differ"
            );
            assert!(
                close(got_b, b),
                "{arch}: sequence {i}, decode logits differ"
            );
        }
        assert_eq!(s3[0].position(), 0, "a failed item evaluates nothing");
    }
}
