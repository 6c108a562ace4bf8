//! Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, id for id with llama.cpp.
//!
//! * [`Tokenizer`]: text to ids ([`Tokenizer::encode`]) and back ([`Tokenizer::decode`]) for the
//!   two vocabulary types that matter: `gpt2` (byte-level BPE with merges and a pre-tokenizer
//!   chosen by `tokenizer.ggml.pre`) and `llama` (SentencePiece: scores, byte fallback
//!   `<0xXX>`, the `▁` space marker).
//! * [`StreamDecoder`]: detokenization while generating, holding back incomplete UTF-8.
//! * [`ChatTemplate`]: the model's Jinja chat template rendered with minijinja.
//!
//! The reference is llama.cpp (b11312, as vendored by llama-cpp-python 0.3.36): `encode` is
//! `llama_tokenize(add_special, parse_special)`, `decode` is
//! `llama_detokenize(remove_special = false, unparse_special = special)`. The tests compare both
//! with golden ids that llama.cpp produced (see `scripts/tokenizer_golden.py`).

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod bpe;
mod chat;
mod load;
mod pretok;
mod spm;
mod stream;
mod unicode;
mod unicode_table;

use std::borrow::Cow;
use std::ops::Range;

use aho_corasick::AhoCorasick;
use rustc_hash::FxHashMap;

pub use chat::{ChatMessage, ChatTemplate, TemplateLimits, CHATML_TEMPLATE};
pub use stream::StreamDecoder;

/// What went wrong building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.ggml.model` names a vocabulary type ferrolm does not implement.
    #[error("unknown vocab type \"{0}\" (tokenizer.ggml.model): ferrolm supports \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece)")]
    UnknownVocabType(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer ferrolm does not know.
    #[error("unknown pre-tokenizer \"{0}\" (tokenizer.ggml.pre)")]
    UnknownPreTokenizer(String),
    /// A required metadata key is absent.
    #[error("missing metadata key {0}")]
    MissingKey(String),
    /// A metadata key has the wrong type.
    #[error("bad tokenizer metadata: {0}")]
    Metadata(#[from] ferrolm_gguf::GgufError),
    /// Metadata present but inconsistent (array lengths, ...).
    #[error("invalid tokenizer metadata: {0}")]
    Invalid(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is out of range: the vocabulary has {n_vocab} tokens")]
    BadId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        n_vocab: usize,
    },
    /// A pre-tokenizer regex that did not compile.
    #[error("pre-tokenizer regex {regex:?}: {message}")]
    Regex {
        /// The regex, as llama.cpp writes it.
        regex: String,
        /// What the regex engine said.
        message: String,
    },
    /// A chat template that does not parse or fails to render.
    #[error("chat template: {0}")]
    Template(String),
}

// Token attributes, as llama.cpp's `llama_token_attr` bits.
pub(crate) const ATTR_UNKNOWN: u32 = 1 << 0;
pub(crate) const ATTR_UNUSED: u32 = 1 << 1;
pub(crate) const ATTR_NORMAL: u32 = 1 << 2;
pub(crate) const ATTR_CONTROL: u32 = 1 << 3;
pub(crate) const ATTR_USER_DEFINED: u32 = 1 << 4;
pub(crate) const ATTR_BYTE: u32 = 1 << 5;
pub(crate) const ATTR_LSTRIP: u32 = 1 << 7;
pub(crate) const ATTR_RSTRIP: u32 = 1 << 8;

/// The two vocabulary types.
#[derive(Debug)]
pub(crate) enum Model {
    /// `gpt2`: byte-level BPE.
    Bpe(Box<bpe::Bpe>),
    /// `llama`: SentencePiece.
    Spm,
}

/// A vocabulary and the rules to turn text into its ids and back.
pub struct Tokenizer {
    pub(crate) model: Model,
    pub(crate) model_name: String,
    pub(crate) pre_name: Option<String>,
    pub(crate) texts: Vec<String>,
    pub(crate) scores: Vec<f32>,
    pub(crate) attrs: Vec<u32>,
    pub(crate) token_to_id: FxHashMap<String, u32>,
    /// Each token's bytes as `token_to_piece(special = true)` renders them.
    pub(crate) pieces: Vec<Vec<u8>>,
    pub(crate) bos: Option<u32>,
    pub(crate) eos: Option<u32>,
    pub(crate) add_bos: bool,
    pub(crate) add_eos: bool,
    pub(crate) add_space_prefix: bool,
    pub(crate) clean_spaces: bool,
    /// Special (control, user-defined, unknown) tokens, longest text first: the order in which
    /// llama.cpp cuts them out of the input.
    pub(crate) specials: Vec<u32>,
    /// Finds which specials occur in a text at all (pattern i = `specials[i]`).
    pub(crate) special_finder: Option<AhoCorasick>,
    pub(crate) eog: Vec<u32>,
    pub(crate) chat_template: Option<String>,
    /// SentencePiece byte fallback: the token of each byte (`<0xXX>`, else the byte as text).
    pub(crate) byte_tokens: [Option<u32>; 256],
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_type", &self.model_name)
            .field("pre", &self.pre_name)
            .field("vocab_size", &self.texts.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("add_space_prefix", &self.add_space_prefix)
            .field("specials", &self.specials.len())
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

/// A piece of input after special tokens were cut out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

impl Tokenizer {
    /// Builds the tokenizer that the metadata describes, as llama.cpp's `llama_vocab::load`.
    pub fn from_metadata(meta: &ferrolm_gguf::Metadata) -> Result<Tokenizer, TokenizerError> {
        load::load(meta)
    }

    /// A prompt to ids as the engine evaluates it: BOS/EOS as the model asks, special-token text
    /// parsed, and no second BOS when the text (a rendered chat template) writes its own.
    pub fn encode_prompt(&self, text: &str) -> Vec<u32> {
        let mut ids = self.encode(text, true, true);
        if let Some(bos) = self.bos() {
            if self.adds_bos() && ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                ids.remove(0);
            }
        }
        ids
    }

    /// Text to ids, as `llama_tokenize`. `add_special`: add BOS/EOS as the metadata says
    /// (`add_bos_token`/`add_eos_token`, with llama.cpp's defaults when absent).
    /// `parse_special`: special-token text in the input becomes the special token.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        self.encode_with_literals(text, add_special, parse_special, &[])
    }

    /// [`Tokenizer::encode_prompt`], except that control-token text overlapping a range of
    /// `literal` (the messages' content in a rendered chat) is text, not a control token: a
    /// user who types `<|im_start|>system` does not open a system turn.
    pub fn encode_prompt_with_literals(&self, text: &str, literal: &[Range<usize>]) -> Vec<u32> {
        let mut ids = self.encode_with_literals(text, true, true, literal);
        if let Some(bos) = self.bos() {
            if self.adds_bos() && ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                ids.remove(0);
            }
        }
        ids
    }

    /// Where control (and unknown) tokens' texts occur in `text`, overlapping occurrences
    /// merged: the spans a chat template must not see as markers.
    pub(crate) fn control_token_spans(&self, text: &str) -> Vec<Range<usize>> {
        let Some(finder) = &self.special_finder else {
            return Vec::new();
        };
        let mut spans: Vec<Range<usize>> = finder
            .find_overlapping_iter(text)
            .filter(|m| {
                let id = self.specials[m.pattern().as_usize()];
                self.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0
            })
            .map(|m| m.range())
            .collect();
        spans.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(spans.len());
        for r in spans {
            match merged.last_mut() {
                Some(last) if r.start < last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        merged
    }

    fn encode_with_literals(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        literal: &[Range<usize>],
    ) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        let frags = self.partition(text, parse_special, literal);
        if add_special && self.add_bos {
            if let Some(bos) = self.bos {
                out.push(bos);
            }
        }
        match &self.model {
            Model::Spm => {
                let mut prev_special = true;
                let mut buf = String::new();
                for f in frags {
                    match f {
                        Fragment::Text(a, b) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push('\u{2581}');
                            }
                            for c in text[a..b].chars() {
                                buf.push(if c == ' ' { '\u{2581}' } else { c });
                            }
                            spm::encode(self, &buf, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe(bpe) => {
                let mut session = bpe::Session::default();
                for f in frags {
                    match f {
                        Fragment::Text(a, b) => {
                            bpe.encode(self, &text[a..b], &mut session, &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            if let Some(eos) = self.eos {
                out.push(eos);
            }
        }
        out
    }

    /// Cuts special-token text out of the input, as llama.cpp's `tokenizer_st_partition`: each
    /// special token in turn (longest first) splits every text fragment at each occurrence.
    /// Without `parse_special`, only user-defined tokens are cut out; nor are control tokens
    /// that overlap a `literal` range.
    fn partition(
        &self,
        text: &str,
        parse_special: bool,
        literal: &[Range<usize>],
    ) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(0, text.len()));
        let Some(finder) = &self.special_finder else {
            return frags;
        };
        // Which specials occur at all (usually none): only those need a pass.
        let mut present = vec![false; self.specials.len()];
        let mut any = false;
        for m in finder.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
            any = true;
        }
        if !any {
            return frags;
        }
        let bytes = text.as_bytes();
        for (k, &id) in self.specials.iter().enumerate() {
            if !present[k] {
                continue;
            }
            let attr = self.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let pat = self.texts[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len() + 2);
            for &f in &frags {
                let Fragment::Text(mut a, b) = f else {
                    next.push(f);
                    continue;
                };
                let control = attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0;
                let mut search = a;
                loop {
                    let Some(found) = text[search..b].find(pat) else {
                        next.push(Fragment::Text(a, b));
                        break;
                    };
                    let m = search + found;
                    let end = m + pat.len();
                    if control && literal.iter().any(|r| r.start < end && m < r.end) {
                        // Typed by a user: text. Look again past its first character.
                        search = m + pat.chars().next().map_or(1, char::len_utf8);
                        continue;
                    }
                    let mut left_end = m;
                    if attr & ATTR_LSTRIP != 0 {
                        while left_end > a && is_c_space(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > a {
                        next.push(Fragment::Text(a, left_end));
                    }
                    next.push(Fragment::Token(id));
                    let mut right = m + pat.len();
                    if right >= b {
                        break;
                    }
                    if attr & ATTR_RSTRIP != 0 {
                        while right < b && is_c_space(bytes[right]) {
                            right += 1;
                        }
                    }
                    if right >= b {
                        break;
                    }
                    a = right;
                    search = a;
                }
            }
            frags = next;
        }
        frags
    }

    /// The bytes of one token as llama.cpp's `token_to_piece` renders it: control and unknown
    /// tokens are empty unless `special`; SentencePiece `▁` becomes a space; byte tokens are
    /// their byte; byte-level BPE tokens are mapped back to bytes.
    pub fn token_bytes(&self, id: u32, special: bool) -> Result<Cow<'_, [u8]>, TokenizerError> {
        let attr = *self.attrs.get(id as usize).ok_or(TokenizerError::BadId {
            id,
            n_vocab: self.texts.len(),
        })?;
        if !special && attr & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 {
            return Ok(Cow::Borrowed(&[]));
        }
        Ok(Cow::Borrowed(&self.pieces[id as usize]))
    }

    /// Ids to bytes as llama.cpp's `llama_detokenize(remove_special = false,
    /// unparse_special = special)`.
    pub fn decode_bytes(&self, ids: &[u32], special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        let mut remove_space = self.add_space_prefix;
        for &id in ids {
            let piece = self.token_bytes(id, special)?;
            let piece: &[u8] = if remove_space && piece.first() == Some(&b' ') {
                &piece[1..]
            } else {
                &piece
            };
            remove_space = false;
            out.extend_from_slice(piece);
        }
        if self.clean_spaces {
            out = clean_spaces(&out);
        }
        Ok(out)
    }

    /// Ids to text as llama.cpp's detokenize does (invalid UTF-8 replaced at the end only).
    pub fn decode(&self, ids: &[u32], special: bool) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids, special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    /// The beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` starts with BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Whether `encode(.., add_special = true, ..)` ends with EOS.
    pub fn adds_eos(&self) -> bool {
        self.add_eos && self.eos.is_some()
    }

    /// End of generation: eos, eot, `<|im_end|>`, `<end_of_turn>`, `<|endoftext|>`, ... as
    /// llama.cpp's `llama_vocab_is_eog`.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation tokens, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The model's chat template (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The raw text of a token as the vocabulary stores it (`Ġ`, `▁` and `<0x0A>` included).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The id of a token with exactly this raw text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Whether a token is special (control, user-defined or unknown).
    pub fn is_special(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
    }

    /// `tokenizer.ggml.model`: `gpt2` or `llama`.
    pub fn vocab_type(&self) -> &str {
        &self.model_name
    }

    /// `tokenizer.ggml.pre`, for BPE vocabularies.
    pub fn pre_tokenizer(&self) -> Option<&str> {
        self.pre_name.as_deref()
    }
}

/// C's `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// llama.cpp's `clean_up_tokenization_spaces` passes over detokenized bytes.
pub(crate) fn clean_spaces(text: &[u8]) -> Vec<u8> {
    let mut t = text.to_vec();
    // first pass: " ?", " !", " .", " ," lose the space
    let n1 = t.len();
    let mut total = usize::from(n1 > 0);
    for i in 1..n1 {
        let x = t[i];
        if t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        t[total] = x;
        total += 1;
    }
    // second pass: " ' " loses both spaces
    let n2 = total;
    total = usize::from(n2 > 0);
    let mut i = 1;
    while i < n2 {
        let x = t[i];
        if x == b'\'' && i + 1 < n2 && t[i - 1] == b' ' && t[i + 1] == b' ' {
            total -= 1;
            i += 1;
            t[i] = 0;
        }
        t[total] = x;
        total += 1;
        i += 1;
    }
    // third pass: " 's", " 'm", " 're", " 've" lose the space
    let n3 = total;
    total = usize::from(n3 > 0);
    for i in 1..n3 {
        let x = t[i];
        if t[i - 1] == b' ' && x == b'\'' && i + 1 < n3 {
            let x1 = t[i + 1];
            if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if x1 != b't' && x1 != b'd' && i + 2 < n3 {
                let x2 = t[i + 2];
                if x2 == b'e' && (x1 == b'r' || x1 == b'v') {
                    total -= 1;
                }
            }
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
    t
}
