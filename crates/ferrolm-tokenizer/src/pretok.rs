//! Pre-tokenizers: how byte-level BPE vocabularies cut text into words before merging,
//! one per `tokenizer.ggml.pre` value, matching llama.cpp's `unicode_regex_split`.
//!
//! llama.cpp applies a list of regexes in turn: each one splits every current fragment into its
//! matches and the gaps between them (both kept), and never looks across a fragment's edge.
//! The common regexes (GPT-2, Llama 3, Qwen 2 and "each digit alone") have hand-written
//! splitters here, as in llama.cpp; the others run through `fancy-regex` on a "collapsed" copy
//! of the fragment, as llama.cpp runs them through `std::regex` (every non-ASCII code point
//! replaced by a stand-in for its category, non-ASCII whitespace by `\x0B`).

use crate::unicode::{self, flags_of, is_letter, is_number, is_whitespace, VALID};
use crate::TokenizerError;

// The regexes of each pre-tokenizer, as llama.cpp b11312 lists them (from each model's
// tokenizer.json, adapted by llama.cpp where std::regex needed it).
const LLAMA3: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
];
const DEEPSEEK3_LLM: &[&str] = &[
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const DEEPSEEK_CODER: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}",
];
const FALCON: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "[0-9][0-9][0-9]",
];
const STARCODER: &[&str] = &[
    "\\p{N}",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];
const GPT2: &[&str] =
    &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const QWEN2: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const PORO: &[&str] = &[" ?[^(\\s|.,!?…。，、।۔،)]+"];
const VIKING: &[&str] = &[" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"];
const TEKKEN: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const GPT4O: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const BAILINGMOE: &[&str] = &[
    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
];
const SEED_CODER: &[&str] = &[
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const UFAKZEKA: &[&str] = &[
    "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const LAGUNA: &[&str] = &[
    "[^\\n]+|[\\n]+",
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const DEFAULT: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "\\p{N}+",
    "[0-9][0-9][0-9]",
];

/// Per-name settings of a BPE vocabulary that depend on `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PreSpec {
    pub regexes: &'static [&'static str],
    /// A word that is itself a token is emitted whole, without merging.
    pub ignore_merges: bool,
    /// Sets llama.cpp's `add_bos` default to true (before `add_bos_token` is read).
    pub add_bos: bool,
    /// llama.cpp's `clean_spaces` (clean_up_tokenization_spaces) for decoding.
    pub clean_spaces: bool,
    /// The vocabulary has no BOS token (ChatGLM).
    pub no_bos: bool,
}

/// Looks up the pre-tokenizer of a `tokenizer.ggml.pre` value; `None` for unknown names.
pub(crate) fn pre_spec(name: &str) -> Option<PreSpec> {
    let s = |regexes, ignore_merges, add_bos, clean_spaces| PreSpec {
        regexes,
        ignore_merges,
        add_bos,
        clean_spaces,
        no_bos: false,
    };
    Some(match name {
        "default" => s(DEFAULT, false, false, true),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => s(LLAMA3, true, true, true),
        "dbrx" | "smaug-bpe" => s(LLAMA3, false, false, true),
        "chatglm-bpe" => PreSpec {
            no_bos: true,
            ..s(LLAMA3, false, false, true)
        },
        "glm4" | "glm5" => PreSpec {
            no_bos: true,
            ..s(LLAMA3, true, false, true)
        },
        "deepseek-llm" => s(DEEPSEEK_LLM, false, false, false),
        "deepseek-coder" => s(DEEPSEEK_CODER, false, false, false),
        "deepseek-v3" => s(DEEPSEEK3_LLM, false, false, false),
        "hunyuan-dense" | "hy_v4" | "joyai-llm" => s(DEEPSEEK3_LLM, false, false, false),
        "falcon" => s(FALCON, false, false, true),
        "mpt" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
        | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code"
        | "roberta-bpe" | "olmo" | "jais" | "exaone4" => s(GPT2, false, false, true),
        "trillion" | "granite-docling" => s(GPT2, false, false, false),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            s(STARCODER, false, false, true)
        }
        "command-r" | "smollm" => s(STARCODER, false, false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "grok-2"
        | "solar-open" => s(QWEN2, false, false, false),
        "stablelm2" | "megrez" => s(QWEN2, false, false, true),
        "poro-chat" => s(PORO, false, false, false),
        "bloom" | "gpt3-finnish" => s(PORO, false, false, true),
        "viking" => s(VIKING, false, false, false),
        "tekken" => s(TEKKEN, true, true, false),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => s(GPT4O, false, false, false),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => s(BAILINGMOE, false, false, false),
        "seed-coder" => s(SEED_CODER, false, false, false),
        "ufakzeka" => s(UFAKZEKA, false, false, false),
        "laguna" => s(LAGUNA, false, false, false),
        _ => return None,
    })
}

const GPT2_RE: &str =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
const LLAMA3_RE: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_RE: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// One splitting pass.
#[derive(Debug)]
enum Step {
    Gpt2,
    Llama3,
    Qwen2,
    /// `\p{N}`: every number code point alone.
    EachNumber,
    /// `[^\n]+|[\n]+`.
    Newlines,
    Regex(StlRegex),
}

/// A pre-tokenizer: its passes, in order.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    steps: Vec<Step>,
}

impl PreTokenizer {
    pub(crate) fn new(regexes: &[&str]) -> Result<PreTokenizer, TokenizerError> {
        let steps = regexes
            .iter()
            .map(|&re| {
                Ok(match re {
                    GPT2_RE => Step::Gpt2,
                    LLAMA3_RE => Step::Llama3,
                    QWEN2_RE => Step::Qwen2,
                    "\\p{N}" => Step::EachNumber,
                    "[^\\n]+|[\\n]+" => Step::Newlines,
                    _ => Step::Regex(StlRegex::new(re)?),
                })
            })
            .collect::<Result<Vec<_>, TokenizerError>>()?;
        Ok(PreTokenizer { steps })
    }

    /// Splits `text` into words: byte ranges that cover it in order.
    pub(crate) fn split(&self, text: &str, out: &mut Vec<(usize, usize)>) {
        out.clear();
        if text.is_empty() {
            return;
        }
        let mut frags = vec![(0usize, text.len())];
        let mut next = Vec::with_capacity(text.len() / 3 + 4);
        let mut buf = CharBuf::default();
        let mut ends = Vec::new();
        let t = unicode::table();
        for step in &self.steps {
            next.clear();
            for &(a, b) in &frags {
                match step {
                    Step::EachNumber => split_each_number(t, text, a, b, &mut next),
                    Step::Newlines => split_newlines(text, a, b, &mut next),
                    Step::Regex(re) => re.split(t, text, a, b, &mut next),
                    Step::Gpt2 | Step::Llama3 | Step::Qwen2 => {
                        buf.fill(t, &text[a..b]);
                        ends.clear();
                        match step {
                            Step::Gpt2 => split_gpt2(&buf, &mut ends),
                            Step::Llama3 => split_llama3(&buf, false, &mut ends),
                            _ => split_llama3(&buf, true, &mut ends),
                        }
                        let mut prev = 0usize;
                        for &end in &ends {
                            next.push((a + buf.offs[prev] as usize, a + buf.offs[end] as usize));
                            prev = end;
                        }
                    }
                }
            }
            std::mem::swap(&mut frags, &mut next);
        }
        out.extend_from_slice(&frags);
    }
}

/// The code points of one fragment with their flags and byte offsets (`offs[n]` = length).
#[derive(Default)]
struct CharBuf {
    cps: Vec<u32>,
    fl: Vec<u8>,
    offs: Vec<u32>,
}

/// Stands for "past the fragment's edge", as llama.cpp's `OUT_OF_RANGE`.
const OUT: u32 = u32::MAX;

impl CharBuf {
    fn fill(&mut self, t: &[u8], s: &str) {
        self.cps.clear();
        self.fl.clear();
        self.offs.clear();
        for (i, c) in s.char_indices() {
            self.cps.push(c as u32);
            self.fl.push(flags_of(t, c));
            self.offs.push(i as u32);
        }
        self.offs.push(s.len() as u32);
    }
    #[inline]
    fn len(&self) -> usize {
        self.cps.len()
    }
    #[inline]
    fn cp(&self, pos: usize) -> u32 {
        self.cps.get(pos).copied().unwrap_or(OUT)
    }
    #[inline]
    fn fl(&self, pos: usize) -> u8 {
        self.fl.get(pos).copied().unwrap_or(0)
    }
}

#[inline]
fn is_other(f: u8) -> bool {
    // [^\s\p{L}\p{N}], inside the fragment
    !(is_whitespace(f) || is_letter(f) || is_number(f)) && f != 0
}

/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, by hand.
/// Pushes the end (in code points) of each word.
fn split_gpt2(b: &CharBuf, ends: &mut Vec<usize>) {
    let n = b.len();
    let mut pos = 0usize;
    while pos < n {
        let cpt = b.cp(pos);
        let flags = b.fl(pos);
        if cpt == '\'' as u32 && pos + 1 < n {
            let c1 = b.cp(pos + 1);
            if [b's', b't', b'm', b'd'].iter().any(|&x| c1 == x as u32) {
                pos += 2;
                ends.push(pos);
                continue;
            }
            if pos + 2 < n {
                let c2 = b.cp(pos + 2);
                let pair = |x: u8, y: u8| c1 == x as u32 && c2 == y as u32;
                if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                    pos += 3;
                    ends.push(pos);
                    continue;
                }
            }
        }
        let space = cpt == ' ' as u32;
        let mut f2 = if space { b.fl(pos + 1) } else { flags };
        if is_letter(f2) || is_number(f2) || is_other(f2) {
            let class_of = |f: u8| -> u8 {
                if is_letter(f) {
                    1
                } else if is_number(f) {
                    2
                } else if is_other(f) {
                    3
                } else {
                    0
                }
            };
            let want = class_of(f2);
            pos += space as usize;
            while class_of(f2) == want {
                pos += 1;
                f2 = b.fl(pos);
            }
            ends.push(pos);
            continue;
        }
        let mut nws = 0usize;
        while is_whitespace(b.fl(pos + nws)) {
            nws += 1;
        }
        if nws > 1 && b.cp(pos + nws) != OUT {
            pos += nws - 1;
            ends.push(pos);
            continue;
        }
        if nws > 0 {
            pos += nws;
            ends.push(pos);
            continue;
        }
        pos += 1;
        ends.push(pos);
    }
}

#[inline]
fn ascii_lower(c: u32) -> u32 {
    if (b'A' as u32..=b'Z' as u32).contains(&c) {
        c + 32
    } else {
        c
    }
}

/// Llama 3's regex (numbers in runs of up to three) or, with `single_digits`, Qwen 2's
/// (each number alone), by hand:
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
fn split_llama3(b: &CharBuf, single_digits: bool, ends: &mut Vec<usize>) {
    let n = b.len();
    let is_rn = |c: u32| c == '\r' as u32 || c == '\n' as u32;
    let mut pos = 0usize;
    while pos < n {
        let cpt = b.cp(pos);
        let flags = b.fl(pos);
        if cpt == '\'' as u32 && pos + 1 < n {
            let c1 = ascii_lower(b.cp(pos + 1));
            if [b's', b't', b'm', b'd'].iter().any(|&x| c1 == x as u32) {
                pos += 2;
                ends.push(pos);
                continue;
            }
            if pos + 2 < n {
                let c2 = ascii_lower(b.cp(pos + 2));
                let pair = |x: u8, y: u8| c1 == x as u32 && c2 == y as u32;
                if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                    pos += 3;
                    ends.push(pos);
                    continue;
                }
            }
        }
        if !(is_rn(cpt) || is_number(flags)) && (is_letter(flags) || is_letter(b.fl(pos + 1))) {
            pos += 1;
            while is_letter(b.fl(pos)) {
                pos += 1;
            }
            ends.push(pos);
            continue;
        }
        if is_number(flags) {
            if single_digits {
                pos += 1;
                ends.push(pos);
                continue;
            }
            let mut ini = pos;
            while is_number(b.fl(pos)) {
                pos += 1;
                if pos - ini >= 3 {
                    ends.push(pos);
                    ini = pos;
                }
            }
            if ends.last() != Some(&pos) {
                ends.push(pos);
            }
            continue;
        }
        let space = cpt == ' ' as u32;
        let mut f2 = if space { b.fl(pos + 1) } else { flags };
        if !(is_whitespace(f2) || is_letter(f2) || is_number(f2)) && flags != 0 {
            pos += space as usize;
            while is_other(f2) {
                pos += 1;
                f2 = b.fl(pos);
            }
            while is_rn(b.cp(pos)) {
                pos += 1;
            }
            ends.push(pos);
            continue;
        }
        let mut nws = 0usize;
        let mut last_rn = 0usize;
        while is_whitespace(b.fl(pos + nws)) {
            if is_rn(b.cp(pos + nws)) {
                last_rn = pos + nws + 1;
            }
            nws += 1;
        }
        if last_rn > 0 {
            pos = last_rn;
            ends.push(pos);
            continue;
        }
        if nws > 1 && b.cp(pos + nws) != OUT {
            pos += nws - 1;
            ends.push(pos);
            continue;
        }
        if nws > 0 {
            pos += nws;
            ends.push(pos);
            continue;
        }
        pos += 1;
        ends.push(pos);
    }
}

/// `\p{N}`: each number code point is a fragment; the runs between them are too.
fn split_each_number(t: &[u8], text: &str, a: usize, b: usize, out: &mut Vec<(usize, usize)>) {
    let s = &text[a..b];
    let mut start = 0usize;
    for (i, c) in s.char_indices() {
        let is_num = if c.is_ascii() {
            c.is_ascii_digit()
        } else {
            is_number(flags_of(t, c))
        };
        if is_num {
            if i > start {
                out.push((a + start, a + i));
            }
            let e = i + c.len_utf8();
            out.push((a + i, a + e));
            start = e;
        }
    }
    if start < s.len() {
        out.push((a + start, b));
    }
}

/// `[^\n]+|[\n]+`: runs of newlines and runs of anything else.
fn split_newlines(text: &str, a: usize, b: usize, out: &mut Vec<(usize, usize)>) {
    let s = &text.as_bytes()[a..b];
    let mut start = 0usize;
    for i in 1..s.len() {
        if (s[i] == b'\n') != (s[i - 1] == b'\n') {
            out.push((a + start, a + i));
            start = i;
        }
    }
    if start < s.len() {
        out.push((a + start, b));
    }
}

// Stand-ins for the categories of non-ASCII code points in the collapsed text, as llama.cpp's
// single bytes 0xD0..0xD5 (here private-use code points, so that the text stays a `str`).
const COLLAPSED_OTHER: char = '\u{E0D0}';
const COLLAPSED: [(u8, char, &str); 5] = [
    (unicode::NUMBER, '\u{E0D1}', "\\x{E0D1}0-9"),
    (unicode::LETTER, '\u{E0D2}', "\\x{E0D2}A-Za-z"),
    (
        unicode::PUNCTUATION,
        '\u{E0D3}',
        "\\x{E0D3}!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    ),
    (unicode::MARK, '\u{E0D4}', "\\x{E0D4}"),
    (unicode::SYMBOL, '\u{E0D5}', "\\x{E0D5}\\$\\+<->\\^`\\|~"),
];

/// The category a `\p{..}` name stands for in a collapsed regex.
fn category_of(name: &str) -> Option<u8> {
    Some(match name {
        "\\p{N}" => unicode::NUMBER,
        "\\p{L}" | "\\p{Lu}" | "\\p{Ll}" | "\\p{Lt}" | "\\p{Lm}" | "\\p{Lo}" => unicode::LETTER,
        "\\p{P}" => unicode::PUNCTUATION,
        "\\p{M}" => unicode::MARK,
        "\\p{S}" => unicode::SYMBOL,
        _ => return None,
    })
}

/// A regex that llama.cpp runs through `std::regex`, emulated with `fancy-regex`.
#[derive(Debug)]
struct StlRegex {
    re: fancy_regex::Regex,
    /// Whether the regex names Unicode categories, so runs on the collapsed text.
    collapsed: bool,
}

impl StlRegex {
    fn new(src: &str) -> Result<StlRegex, TokenizerError> {
        let collapsed = ["\\p{N}", "\\p{L}", "\\p{P}", "\\p{M}", "\\p{S}"]
            .iter()
            .any(|p| src.contains(p));
        let translated = if collapsed {
            collapse_regex(src)?
        } else {
            src.to_string()
        };
        let re = fancy_regex::Regex::new(&translated).map_err(|e| TokenizerError::Regex {
            regex: src.to_string(),
            message: e.to_string(),
        })?;
        Ok(StlRegex { re, collapsed })
    }

    fn split(&self, t: &[u8], text: &str, a: usize, b: usize, out: &mut Vec<(usize, usize)>) {
        let s = &text[a..b];
        // The text the regex sees, and for each of its byte offsets the offset in `s`.
        let mut conv = String::with_capacity(s.len());
        let mut map = Vec::with_capacity(s.len() + 1);
        for (i, c) in s.char_indices() {
            let f = flags_of(t, c);
            let d = if c.is_ascii() {
                c
            } else if is_whitespace(f) {
                '\u{0B}'
            } else if !self.collapsed {
                c
            } else {
                COLLAPSED
                    .iter()
                    .find(|x| f & VALID != 0 && unicode::class(f) == x.0)
                    .map_or(COLLAPSED_OTHER, |x| x.1)
            };
            conv.push(d);
            map.extend(std::iter::repeat_n(i, d.len_utf8()));
        }
        map.push(s.len());
        let mut start = 0usize;
        for m in self.re.find_iter(&conv) {
            // A backtracking limit is the only error; llama.cpp would have thrown, we stop
            // matching and keep the rest of the fragment whole.
            let Ok(m) = m else { break };
            if m.start() > start {
                out.push((a + map[start], a + map[m.start()]));
            }
            if m.end() > m.start() {
                out.push((a + map[m.start()], a + map[m.end()]));
            }
            start = m.end();
        }
        if start < conv.len() {
            out.push((a + map[start], b));
        }
    }
}

/// Rewrites `\p{..}` classes of a regex for the collapsed text, as llama.cpp does.
fn collapse_regex(src: &str) -> Result<String, TokenizerError> {
    if !src.is_ascii() {
        return Err(TokenizerError::Regex {
            regex: src.to_string(),
            message: "unicode categories together with non-ASCII characters".into(),
        });
    }
    let bytes = src.as_bytes();
    let mut out = String::new();
    let mut inside = false;
    let mut i = 0usize;
    while i < bytes.len() {
        let c = bytes[i];
        let prev_backslash = i > 0 && bytes[i - 1] == b'\\';
        if c == b'[' && !prev_backslash {
            out.push('[');
            inside = true;
            i += 1;
            continue;
        }
        if inside && c == b']' && !prev_backslash {
            out.push(']');
            inside = false;
            i += 1;
            continue;
        }
        if c == b'\\' && i + 3 < bytes.len() && bytes[i + 1] == b'p' && bytes[i + 2] == b'{' {
            if let Some(close) = src[i + 3..].find('}').map(|k| k + i + 3) {
                if close <= i + 10 {
                    if let Some(cat) = category_of(&src[i..=close]) {
                        let class = COLLAPSED.iter().find(|x| x.0 == cat).expect("known").2;
                        if !inside {
                            out.push('[');
                        }
                        out.push_str(class);
                        if !inside {
                            out.push(']');
                        }
                        i = close + 1;
                        continue;
                    }
                }
            }
        }
        out.push(c as char);
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: &str, text: &str) -> Vec<String> {
        let p = PreTokenizer::new(pre_spec(pre).unwrap().regexes).unwrap();
        let mut out = Vec::new();
        p.split(text, &mut out);
        let joined: String = out.iter().map(|&(a, b)| &text[a..b]).collect();
        assert_eq!(joined, text, "words must cover the text");
        out.iter().map(|&(a, b)| text[a..b].to_string()).collect()
    }

    #[test]
    fn every_known_pre_tokenizer_compiles() {
        for name in [
            "default",
            "llama3",
            "llama-bpe",
            "dbrx",
            "chatglm-bpe",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "falcon",
            "gpt-2",
            "starcoder",
            "smollm",
            "qwen2",
            "stablelm2",
            "poro-chat",
            "viking",
            "tekken",
            "gpt-4o",
            "bailingmoe",
            "seed-coder",
            "ufakzeka",
            "laguna",
        ] {
            let spec = pre_spec(name).unwrap();
            PreTokenizer::new(spec.regexes).unwrap();
            words(name, "Hello world's 12345 ÀÉ 你好  \n\n x! ?? 😀");
        }
        assert!(pre_spec("xyz").is_none());
    }

    #[test]
    fn gpt2_words() {
        assert_eq!(
            words("gpt-2", "Hello world's   x"),
            ["Hello", " world", "'s", "  ", " x"]
        );
        assert_eq!(words("smollm", "ab 123"), ["ab", " ", "1", "2", "3"]);
    }

    #[test]
    fn llama3_words() {
        assert_eq!(
            words("llama3", "Hello WORLD'S 1234567 !!\n\n  x"),
            ["Hello", " WORLD", "'S", " ", "123", "456", "7", " !!\n\n", " ", " x"]
        );
    }
}
