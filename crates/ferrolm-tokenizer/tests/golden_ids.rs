//! Every corpus string tokenizes to exactly llama.cpp's ids, and every id sequence decodes to
//! exactly llama.cpp's bytes, on both real models (goldens from scripts/tokenizer_golden.py).

mod common;

use common::*;
use ferrolm_tokenizer::{StreamDecoder, Tokenizer};

fn check_model(golden: &str, file: &str) {
    let tok = load(file);
    let g = read_json(golden);
    let corpus = corpus();
    assert_eq!(g["n_vocab"].as_u64().unwrap() as usize, tok.vocab_size());
    assert_eq!(
        g["bos"].as_i64().unwrap(),
        tok.bos().map_or(-1, i64::from),
        "bos"
    );
    assert_eq!(
        g["eos"].as_i64().unwrap(),
        tok.eos().map_or(-1, i64::from),
        "eos"
    );
    assert_eq!(ids_of(&g["eog"]), tok.eog_ids(), "end-of-generation tokens");

    let mut failures = Vec::new();
    let cases = g["cases"].as_array().unwrap();
    let mut strings_ok = vec![true; corpus.len()];
    for c in cases {
        let i = c["i"].as_u64().unwrap() as usize;
        let add = c["add_special"].as_bool().unwrap();
        let parse = c["parse_special"].as_bool().unwrap();
        let want = ids_of(&c["ids"]);
        let got = tok.encode(&corpus[i], add, parse);
        if got != want {
            strings_ok[i] = false;
            failures.push(format!(
                "encode #{i} {:?} add={add} parse={parse}\n   llama.cpp {want:?}\n   ferrolm   {got:?}",
                corpus[i]
            ));
        }
        for (field, special) in [("decode_special", true), ("decode_plain", false)] {
            if let Some(exp) = c.get(field) {
                let exp = expected_bytes(exp);
                let got = tok.decode_bytes(&want, special).unwrap();
                if got != exp {
                    strings_ok[i] = false;
                    failures.push(format!(
                        "decode #{i} special={special} {want:?}\n   llama.cpp {:?}\n   ferrolm   {:?}",
                        String::from_utf8_lossy(&exp),
                        String::from_utf8_lossy(&got)
                    ));
                }
            }
        }
    }
    for d in g["decodes"].as_array().unwrap() {
        let ids = ids_of(&d["ids"]);
        for (field, special) in [("decode_special", true), ("decode_plain", false)] {
            let exp = expected_bytes(&d[field]);
            let got = tok.decode_bytes(&ids, special).unwrap();
            if got != exp {
                failures.push(format!(
                    "decode {ids:?} special={special}\n   llama.cpp {:?}\n   ferrolm   {:?}",
                    String::from_utf8_lossy(&exp),
                    String::from_utf8_lossy(&got)
                ));
            }
        }
    }
    let matched = strings_ok.iter().filter(|&&x| x).count();
    eprintln!(
        "{file}: {matched}/{} corpus strings match llama.cpp (all modes)",
        corpus.len()
    );
    assert!(
        failures.is_empty(),
        "{} mismatches with llama.cpp on {file}:\n{}",
        failures.len(),
        failures
            .iter()
            .take(25)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn smollm2_matches_llama_cpp() {
    check_model("smollm2.json", SMOLLM2);
}

#[test]
fn gemma3_matches_llama_cpp() {
    check_model("gemma3.json", GEMMA3);
}

fn check_stream(tok: &Tokenizer, ids: &[u32], special: bool) {
    let mut dec = StreamDecoder::with_special(tok, special);
    let mut all = String::new();
    for &id in ids {
        let s = dec.push(id).unwrap();
        all.push_str(&s); // a String: never a broken UTF-8 character
    }
    all.push_str(&dec.finish());
    assert_eq!(all, tok.decode(ids, special).unwrap(), "stream of {ids:?}");
}

fn stream_model(golden: &str, file: &str) {
    let tok = load(file);
    let g = read_json(golden);
    for c in g["cases"].as_array().unwrap() {
        let ids = ids_of(&c["ids"]);
        check_stream(&tok, &ids, true);
        check_stream(&tok, &ids, false);
    }
    for d in g["decodes"].as_array().unwrap() {
        let ids = ids_of(&d["ids"]);
        check_stream(&tok, &ids, true);
        check_stream(&tok, &ids, false);
    }
}

#[test]
fn smollm2_streaming_equals_decode() {
    stream_model("smollm2.json", SMOLLM2);
}

#[test]
fn gemma3_streaming_equals_decode() {
    stream_model("gemma3.json", GEMMA3);
}

#[test]
fn streaming_holds_back_split_characters() {
    let tok = load(GEMMA3);
    // "€" is E2 82 AC: three byte tokens
    let ids: Vec<u32> = ["<0xE2>", "<0x82>", "<0xAC>"]
        .iter()
        .map(|t| tok.token_id(t).unwrap())
        .collect();
    let mut dec = StreamDecoder::new(&tok);
    assert_eq!(dec.push(ids[0]).unwrap(), "");
    assert_eq!(dec.push(ids[1]).unwrap(), "");
    assert_eq!(dec.push(ids[2]).unwrap(), "€");
    assert_eq!(dec.finish(), "");
    let mut dec = StreamDecoder::new(&tok);
    assert_eq!(dec.push(ids[0]).unwrap(), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
}

#[test]
fn bad_ids_are_errors() {
    let tok = load(SMOLLM2);
    let n = tok.vocab_size() as u32;
    assert!(tok.decode(&[n], false).is_err());
    assert!(tok.token_bytes(n + 5, true).is_err());
    assert!(StreamDecoder::new(&tok).push(n).is_err());
}

#[test]
fn specials_and_eog() {
    let s = load(SMOLLM2);
    let im_end = s.token_id("<|im_end|>").unwrap();
    assert!(s.is_eog(im_end));
    assert!(s.is_eog(s.token_id("<|endoftext|>").unwrap()));
    assert!(!s.is_eog(s.token_id("<|im_start|>").unwrap()));
    assert_eq!(
        s.chat_template().map(|t| t.contains("<|im_start|>")),
        Some(true)
    );
    let g = load(GEMMA3);
    assert!(g.is_eog(g.token_id("<end_of_turn>").unwrap()));
    assert!(g.is_eog(g.eos().unwrap()));
    assert_eq!(g.encode("", true, true), vec![g.bos().unwrap()]);
    assert_eq!(g.encode("", false, true), Vec::<u32>::new());
}
