//! Constrained sampling over the default model's vocabulary with random logits (the model
//! itself is not needed): whatever the logits say, the output follows the grammar.

use std::sync::Arc;

use ferrolm_engine::constraint::{Constraints, Grammar};
use ferrolm_engine::sequence::{Sequence, SequenceParams};
use ferrolm_engine::SamplerParams;
use ferrolm_tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};
use serde_json::json;

fn tokenizer() -> Tokenizer {
    let home = std::env::var_os("FERROLM_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/ferrolm")
        });
    let path = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let file = ferrolm_gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run `ferrolm pull`)", path.display()));
    Tokenizer::from_metadata(file.metadata()).unwrap()
}

/// Generates under `grammar` from random logits (seeded), at temperature 1; the text and
/// whether it ended by itself (not at `max_tokens`).
fn generate(
    tok: &Tokenizer,
    constraints: &Constraints,
    grammar: &Grammar,
    seed: u64,
) -> (String, bool) {
    let params = SequenceParams {
        max_tokens: 300,
        sampler: SamplerParams {
            temperature: 1.0,
            top_k: 0,
            seed,
            ..SamplerParams::default()
        },
        stop: Vec::new(),
        stop_at_eog: true,
    };
    let mut seq = Sequence::new(tok, vec![1, 2, 3], params, 4096)
        .with_constraint(Some(constraints.compile(grammar).unwrap()));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut text = String::new();
    let (ids, _) = seq.next_input(16);
    let mut n = ids.len();
    loop {
        let logits: Vec<f32> = (0..tok.vocab_size())
            .map(|_| rng.random::<f32>() * 8.0)
            .collect();
        let step = seq.advance(n, Some(&logits)).unwrap();
        text.push_str(&step.text);
        n = 1;
        if let Some(reason) = step.finished {
            return (text, reason == ferrolm_engine::FinishReason::Stop);
        }
    }
}

#[test]
fn random_logits_under_a_schema_give_valid_json() {
    let tok = tokenizer();
    let constraints = Constraints::new(Arc::new(tokenizer())).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": false,
    });
    let grammar = Grammar::JsonSchema(schema);
    for seed in 0..4 {
        let (text, ended) = generate(&tok, &constraints, &grammar, seed);
        assert!(ended, "seed {seed}: did not end: {text:?}");
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        assert!(
            v["name"].as_str().is_some_and(|s| s.chars().count() <= 8),
            "{v}"
        );
        assert!(v["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
        let pets = v["pets"].as_array().unwrap();
        assert!(
            pets.len() <= 3 && pets.iter().all(|p| p == "cat" || p == "dog"),
            "{v}"
        );
        assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
    }
}

#[test]
fn json_object_and_lark_grammars_hold_and_bad_ones_are_named() {
    let tok = tokenizer();
    let constraints = Constraints::new(Arc::new(tokenizer())).unwrap();
    let (text, ended) = generate(&tok, &constraints, &Grammar::JsonObject, 7);
    if ended {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(v.is_object(), "{text}");
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
    let yes_no = Grammar::Lark("start: \"yes\" | \"no\"".into());
    for seed in 0..3 {
        let (text, ended) = generate(&tok, &constraints, &yes_no, seed);
        assert!(ended && (text == "yes" || text == "no"), "{text:?}");
    }
    // A schema with local references (as pydantic writes nested models).
    let nested = Grammar::JsonSchema(json!({
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"], "additionalProperties": false}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "additionalProperties": false,
    }));
    for seed in 0..2 {
        let (text, ended) = generate(&tok, &constraints, &nested, seed);
        assert!(ended, "{text:?}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(v["p"]["x"].as_u64().is_some_and(|x| x <= 9), "{v}");
    }
    let e = constraints
        .compile(&Grammar::JsonSchema(json!({"type": "no-such-type"})))
        .unwrap_err();
    assert!(e.contains("no-such-type"), "{e}");
    let e = constraints
        .compile(&Grammar::Lark("start: undefined_rule".into()))
        .unwrap_err();
    assert!(e.contains("undefined_rule"), "{e}");
}
