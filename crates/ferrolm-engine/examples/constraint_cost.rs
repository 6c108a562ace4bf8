//! What a JSON schema costs per sampled token, on the default model's vocabulary with random
//! logits and no forward pass to hide behind: the upper bound of constrained decoding's
//! overhead (in the server, the mask is computed while the next forward pass runs).
//!
//!     cargo run --release -p ferrolm-engine --example constraint_cost [MODEL.gguf]

use std::sync::Arc;
use std::time::Instant;

use ferrolm_engine::constraint::{Constraints, Grammar};
use ferrolm_engine::sequence::{Sequence, SequenceParams};
use ferrolm_engine::SamplerParams;
use ferrolm_tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};

fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("{home}/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    let file = ferrolm_gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let tok = Arc::new(Tokenizer::from_metadata(file.metadata()).unwrap());
    let start = Instant::now();
    let constraints = Constraints::new(tok.clone()).unwrap();
    println!(
        "token trie and parser factory: {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 500},
        },
        "required": ["name", "items"],
    });
    let steps = 400;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let logits: Vec<Vec<f32>> = (0..steps)
        .map(|_| {
            (0..tok.vocab_size())
                .map(|_| rng.random::<f32>() * 8.0)
                .collect()
        })
        .collect();
    for constrained in [false, true] {
        let params = SequenceParams {
            max_tokens: steps,
            sampler: SamplerParams {
                seed: 1,
                ..SamplerParams::default()
            },
            stop: Vec::new(),
            stop_at_eog: false,
        };
        let grammar = Grammar::JsonSchema(schema.clone());
        let constraint = constrained.then(|| constraints.compile(&grammar).unwrap());
        let mut seq = Sequence::new(&tok, vec![1], params, steps + 8).with_constraint(constraint);
        let start = Instant::now();
        let mut n = 1;
        let mut tokens = 0;
        for l in &logits {
            let step = seq.advance(n, Some(l)).unwrap();
            n = 1;
            tokens += usize::from(step.token.is_some());
            if step.finished.is_some() {
                break;
            }
        }
        let per = start.elapsed().as_secs_f64() * 1e6 / tokens.max(1) as f64;
        println!(
            "{:>12}: {per:.0} us per token over {tokens} tokens",
            if constrained {
                "with schema"
            } else {
                "without"
            }
        );
    }
}
