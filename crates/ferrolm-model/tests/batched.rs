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

/// A pass that starts at layer 0 from the embedding rows (what a GPU holding no layers would
/// hand over, `--gpu-layers`) is the plain pass, bit for bit, batch and decode step alike; a
/// hidden stream of the wrong length, or a layer past the last, is an error.
#[test]
fn a_pass_started_from_the_embedding_is_the_plain_pass() {
    let m = model("llama");
    let d = m.plan().n_embd;
    let embd = m.file().tensor("token_embd.weight").unwrap();
    let rows = |ids: &[u32]| -> Vec<f32> {
        let row_bytes = embd.size as usize / m.plan().n_vocab;
        let data = m.file().tensor_data(embd);
        let mut out = vec![0f32; ids.len() * d];
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            ferrolm_quant::dequantize(
                embd.ty,
                &data[id * row_bytes..(id + 1) * row_bytes],
                &mut out[i * d..(i + 1) * d],
            )
            .unwrap();
        }
        out
    };
    let prompt: Vec<u32> = (0..13).map(|i| (i * 31 + 5) % 200).collect();
    let mut plain = m.session(64);
    let mut split = m.session(64);
    let a = plain.eval(&prompt, Logits::All).unwrap();
    let b = split
        .eval_from(&prompt, 0, &rows(&prompt), Logits::All)
        .unwrap();
    assert_eq!(a, b);
    let a = plain.eval(&[42], Logits::Last).unwrap();
    let b = split
        .eval_from(&[42], 0, &rows(&[42]), Logits::Last)
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(split.position(), plain.position());
    assert!(split
        .eval_from(&[1, 2], 0, &rows(&[1]), Logits::Last)
        .is_err());
    let layers = m.plan().layers.len();
    assert!(split
        .eval_from(&[1], layers + 1, &rows(&[1]), Logits::Last)
        .is_err());
}
