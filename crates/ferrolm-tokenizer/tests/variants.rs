//! Pre-tokenizers and options that no packaged model uses, against llama.cpp: the real models'
//! metadata with one tokenizer key changed (goldens from scripts/tokenizer_variants_golden.py),
//! plus clear errors for what is not supported.

mod common;

use common::*;
use ferrolm_gguf::{Metadata, Value};
use ferrolm_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

fn metadata(file: &str) -> Metadata {
    let path = ferrolm_home().join("models").join(file);
    assert!(
        path.exists(),
        "model {} not found: run `cargo run --release -p ferrolm -- pull` first",
        path.display()
    );
    ferrolm_gguf::GgufFile::open(&path)
        .unwrap()
        .metadata()
        .clone()
}

fn to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::String(s) => Value::String(s.clone()),
        serde_json::Value::Bool(b) => Value::Bool(*b),
        other => panic!("unexpected change {other}"),
    }
}

#[test]
fn variants_match_llama_cpp() {
    let g = read_json("variants.json");
    let corpus = corpus();
    let strings: Vec<usize> = g["strings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    let smol = metadata(SMOLLM2);
    let gemma = metadata(GEMMA3);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for v in g["variants"].as_array().unwrap() {
        let name = v["name"].as_str().unwrap();
        let mut meta = if v["base"] == "smollm2" {
            smol.clone()
        } else {
            gemma.clone()
        };
        for (k, val) in v["changes"].as_object().unwrap() {
            meta.set(k.clone(), to_value(val));
        }
        let tok = Tokenizer::from_metadata(&meta).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut ok = 0;
        for (k, &i) in strings.iter().enumerate() {
            let want = ids_of(&v["ids"][k]);
            let got = tok.encode(&corpus[i], true, true);
            let want_text = expected_bytes(&v["decode_plain"][k]);
            let got_text = tok.decode_bytes(&want, false).unwrap();
            // streaming gives the same text (these variants include clean_spaces ones)
            let mut sd = StreamDecoder::new(&tok);
            let mut streamed = String::new();
            for &id in &want {
                streamed.push_str(&sd.push(id).unwrap());
            }
            streamed.push_str(&sd.finish());
            assert_eq!(
                streamed,
                String::from_utf8_lossy(&got_text),
                "{name}: stream of {want:?}"
            );
            if got == want && got_text == want_text {
                ok += 1;
            } else if failures.len() < 30 {
                failures.push(format!(
                    "{name} #{i} {:?}\n   llama.cpp {want:?} {:?}\n   ferrolm   {got:?} {:?}",
                    corpus[i],
                    String::from_utf8_lossy(&want_text),
                    String::from_utf8_lossy(&got_text)
                ));
            }
        }
        report.push(format!(
            "{}/{name}: {ok}/{}",
            v["base"].as_str().unwrap(),
            strings.len()
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unknown_types_are_clear_errors() {
    let mut m = metadata(SMOLLM2);
    m.set("tokenizer.ggml.pre", Value::String("xyz".into()));
    let e = Tokenizer::from_metadata(&m).unwrap_err();
    assert!(
        matches!(e, TokenizerError::UnknownPreTokenizer(ref p) if p == "xyz"),
        "{e}"
    );
    assert!(
        e.to_string().contains("unknown pre-tokenizer \"xyz\""),
        "{e}"
    );

    for model in ["bert", "t5", "rwkv", "ugm"] {
        let mut m = metadata(SMOLLM2);
        m.set("tokenizer.ggml.model", Value::String(model.into()));
        let e = Tokenizer::from_metadata(&m).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("unknown vocab type \"{model}\"")),
            "{e}"
        );
    }

    let mut m = Metadata::default();
    m.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    m.set("tokenizer.ggml.pre", Value::String("smollm".into()));
    let e = Tokenizer::from_metadata(&m).unwrap_err();
    assert!(
        e.to_string()
            .contains("missing metadata key tokenizer.ggml.tokens"),
        "{e}"
    );
    let e = Tokenizer::from_metadata(&Metadata::default()).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.model"), "{e}");

    let mut m = metadata(SMOLLM2);
    m.set("tokenizer.ggml.merges", Value::U32(3));
    assert!(Tokenizer::from_metadata(&m).is_err());
}

#[test]
fn missing_pre_is_default_for_bpe() {
    let smol = metadata(SMOLLM2);
    let mut m = Metadata::default();
    for (k, v) in smol.iter() {
        if k != "tokenizer.ggml.pre" {
            m.set(k, v.clone());
        }
    }
    let tok = Tokenizer::from_metadata(&m).unwrap();
    let mut d = smol.clone();
    d.set("tokenizer.ggml.pre", Value::String("default".into()));
    let def = Tokenizer::from_metadata(&d).unwrap();
    let text = "Hello, world! 12345 (it's) $x+y";
    assert_eq!(tok.encode(text, true, true), def.encode(text, true, true));
}
