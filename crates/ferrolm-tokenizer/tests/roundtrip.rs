//! Detokenization round-trips: for both real models, decode(encode(text)) == text for the whole
//! corpus and for pseudo-random strings over many scripts, and nothing panics.

mod common;

use common::*;
use ferrolm_tokenizer::{StreamDecoder, Tokenizer};

/// xorshift64*: a fixed-seed generator, so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Code points up to plane 2: SmolLM2's byte alphabet lacks the lead bytes of planes 4 and up
/// (0xF1..), which llama.cpp then drops, and so do we (the goldens check that).
fn random_strings(n: usize) -> Vec<String> {
    let ranges: &[(u32, u32)] = &[
        (0x20, 0x7E),
        (0x09, 0x0D),
        (0xA0, 0x24F),
        (0x300, 0x36F),
        (0x370, 0x4FF),
        (0x590, 0x6FF),
        (0x900, 0x97F),
        (0xE00, 0xE7F),
        (0x2000, 0x206F),
        (0x3000, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0xE000, 0xE0FF),
        (0xFF00, 0xFFEF),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x2FFFF),
    ];
    let mut rng = Rng(0x9E3779B97F4A7C15);
    (0..n)
        .map(|_| {
            let len = 1 + rng.below(30);
            (0..len)
                .filter_map(|_| {
                    let (a, b) = ranges[rng.below(ranges.len())];
                    char::from_u32(a + rng.below((b - a + 1) as usize) as u32)
                })
                .collect()
        })
        .collect()
}

/// `spm`: SentencePiece decodes an input `▁` as a space, as llama.cpp does; skip those.
fn round_trip(tok: &Tokenizer, texts: &[String]) {
    let mut bad = Vec::new();
    let spm = tok.vocab_type() == "llama";
    for t in texts.iter().filter(|t| !(spm && t.contains('\u{2581}'))) {
        // parse_special = false: special-looking text stays text (control tokens are not cut out)
        let ids = tok.encode(t, false, false);
        let back = tok.decode(&ids, true).unwrap();
        if &back != t {
            bad.push(format!("{t:?} -> {ids:?} -> {back:?}"));
        }
        let mut s = StreamDecoder::with_special(tok, true);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&s.push(id).unwrap());
        }
        streamed.push_str(&s.finish());
        assert_eq!(streamed, back);
    }
    assert!(
        bad.is_empty(),
        "{} strings do not round-trip:\n{}",
        bad.len(),
        bad[..bad.len().min(20)].join("\n")
    );
}

#[test]
fn smollm2_round_trips() {
    let tok = load(SMOLLM2);
    round_trip(&tok, &corpus());
    round_trip(&tok, &random_strings(3000));
}

#[test]
fn gemma3_round_trips() {
    let tok = load(GEMMA3);
    round_trip(&tok, &corpus());
    round_trip(&tok, &random_strings(3000));
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}
