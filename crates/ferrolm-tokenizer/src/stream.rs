//! Detokenization while generating.

use crate::{clean_spaces, Tokenizer, TokenizerError};

/// Bytes of cleaned output held back while `clean_spaces` may still change them.
const CLEAN_HOLD: usize = 8;

/// Incremental detokenizer: push ids as they are generated, get the text that is complete.
///
/// The concatenation of everything [`StreamDecoder::push`] and [`StreamDecoder::finish`]
/// return equals [`Tokenizer::decode`] of all the ids: the first token loses its leading space
/// when the vocabulary adds a space prefix (SentencePiece), as llama.cpp's detokenize does, and
/// an incomplete UTF-8 sequence is held back until it completes (or turns out invalid, when it
/// becomes U+FFFD exactly as in `decode`).
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    special: bool,
    first: bool,
    /// Bytes not yet returned (the tail of an incomplete UTF-8 sequence).
    pending: Vec<u8>,
    /// With `clean_spaces`: the cleaning of the raw bytes.
    clean: CleanStream,
}

/// `clean_spaces` applied to a stream of raw bytes: cleans the bytes since the last point
/// where no rule can reach across, and returns the cleaned bytes no later byte can change.
#[derive(Default)]
struct CleanStream {
    /// Raw bytes since the last safe cut.
    raw: Vec<u8>,
    /// How many bytes of `clean_spaces(raw)` were already returned.
    used: usize,
}

/// Bytes that take part in a cleaning rule.
fn active(b: u8) -> bool {
    matches!(b, b' ' | b'\'' | b'?' | b'!' | b'.' | b',')
}

impl CleanStream {
    fn push(&mut self, bytes: &[u8]) -> Vec<u8> {
        self.raw.extend_from_slice(bytes);
        let mut out = Vec::new();
        // The last cut p with raw[p-2..p+2] free of rule bytes: no rule looks across it, so
        // clean(raw) = clean(raw[..p]) + clean(raw[p..]).
        let r = &self.raw;
        let cut = (2..r.len().saturating_sub(1))
            .rev()
            .find(|&p| !r[p - 2..p + 2].iter().any(|&b| active(b)));
        if let Some(p) = cut {
            let head = clean_spaces(&self.raw[..p]);
            if self.used <= head.len() {
                out.extend_from_slice(&head[self.used..]);
                self.used = 0;
            } else {
                self.used -= head.len();
            }
            self.raw.drain(..p);
        }
        let cleaned = clean_spaces(&self.raw);
        let stable = cleaned.len().saturating_sub(CLEAN_HOLD);
        if stable > self.used {
            out.extend_from_slice(&cleaned[self.used..stable]);
            self.used = stable;
        }
        out
    }

    fn finish(&mut self) -> Vec<u8> {
        let cleaned = clean_spaces(&self.raw);
        let out = cleaned.get(self.used..).unwrap_or_default().to_vec();
        self.raw.clear();
        self.used = 0;
        out
    }
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that leaves control tokens out (`decode(ids, false)`).
    pub fn new(tok: &'a Tokenizer) -> Self {
        Self::with_special(tok, false)
    }

    /// A decoder that renders special tokens as their text when `special` is true.
    pub fn with_special(tok: &'a Tokenizer, special: bool) -> Self {
        StreamDecoder {
            tok,
            special,
            first: true,
            pending: Vec::new(),
            clean: CleanStream::default(),
        }
    }

    /// Adds one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let piece = self.tok.token_bytes(id, self.special)?;
        let mut piece: &[u8] = &piece;
        if self.first && self.tok.add_space_prefix && piece.first() == Some(&b' ') {
            piece = &piece[1..];
        }
        self.first = false;
        if self.tok.clean_spaces {
            let done = self.clean.push(piece);
            self.pending.extend_from_slice(&done);
        } else {
            self.pending.extend_from_slice(piece);
        }
        Ok(self.take_complete())
    }

    /// Ends the stream: returns what was held back (an incomplete sequence becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        if self.tok.clean_spaces {
            let rest = self.clean.finish();
            self.pending.extend_from_slice(&rest);
        }
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// Takes the longest prefix of `pending` that no later byte can change.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (ok, tail) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(ok).expect("valid prefix"));
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &tail[bad..];
                        }
                        None => {
                            rest = tail; // incomplete: wait for more bytes
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let drop = self.pending.len() - keep;
        self.pending.drain(..drop);
        out
    }
}

#[cfg(test)]
mod tests {
    use crate::clean_spaces;

    #[test]
    fn cleaning_a_prefix_is_stable_but_for_the_tail() {
        // a simple deterministic generator over the bytes the passes care about
        let alphabet = b" 'smtdrevl?!.,a";
        let mut state = 12345u64;
        for _ in 0..2000 {
            let mut s = Vec::new();
            let len = (state % 24) as usize + 1;
            for _ in 0..len {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                s.push(alphabet[(state >> 33) as usize % alphabet.len()]);
            }
            let full = clean_spaces(&s);
            for k in 0..=s.len() {
                let part = clean_spaces(&s[..k]);
                let stable = part.len().saturating_sub(super::CLEAN_HOLD);
                assert_eq!(
                    &part[..stable],
                    &full[..stable],
                    "{:?} at {k}",
                    String::from_utf8_lossy(&s)
                );
            }
        }
    }

    #[test]
    fn streamed_cleaning_equals_cleaning_the_whole() {
        let alphabet = b" 'smtdrevl?!.,abc";
        let mut state = 99u64;
        let mut next = |m: usize| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as usize % m
        };
        for _ in 0..3000 {
            let len = next(60) + 1;
            let s: Vec<u8> = (0..len).map(|_| alphabet[next(alphabet.len())]).collect();
            let mut cs = super::CleanStream::default();
            let mut out = Vec::new();
            let mut i = 0;
            while i < s.len() {
                let k = (next(5) + 1).min(s.len() - i);
                out.extend(cs.push(&s[i..i + k]));
                i += k;
            }
            out.extend(cs.finish());
            assert_eq!(out, clean_spaces(&s), "{:?}", String::from_utf8_lossy(&s));
        }
    }

    #[test]
    fn clean_spaces_like_llama_cpp() {
        assert_eq!(clean_spaces(b"Hello , world !"), b"Hello, world!");
        assert_eq!(clean_spaces(b"it ' s"), b"it's");
        assert_eq!(clean_spaces(b"he 's here , we 're"), b"he's here, we're");
        assert_eq!(clean_spaces(b"don 't"), b"don 't");
    }
}
