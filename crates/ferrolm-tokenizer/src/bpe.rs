//! Byte-level BPE (`tokenizer.ggml.model = gpt2`), as llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! Every word from the pre-tokenizer starts as one symbol per byte (GPT-2's byte alphabet), and
//! the adjacent pair with the lowest merge rank merges first (leftmost among equals) until no
//! pair has a rank. Symbols are ids: vocabulary ids, or ids past the vocabulary for the rare
//! merge parts that are not tokens themselves, so a merge is one hash lookup of two integers.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use crate::pretok::PreTokenizer;
use crate::unicode;
use crate::Tokenizer;

/// The merge table and byte alphabet of a BPE vocabulary.
#[derive(Debug)]
pub(crate) struct Bpe {
    pre: PreTokenizer,
    ignore_merges: bool,
    n_vocab: u32,
    /// The symbol of each byte.
    byte_sym: [u32; 256],
    /// The character of each byte in GPT-2's alphabet.
    byte_char: [char; 256],
    char_byte: Vec<Option<u8>>,
    /// (left, right) -> (rank, merged symbol).
    merges: FxHashMap<u64, (u32, u32)>,
    /// Texts of the symbols past the vocabulary.
    extra: Vec<String>,
    /// The token of each single byte text (for symbols that are not tokens).
    single_byte_token: [Option<u32>; 256],
}

/// Per-call scratch space and word cache.
#[derive(Default)]
pub(crate) struct Session {
    words: Vec<(usize, usize)>,
    syms: Vec<u32>,
    cache: FxHashMap<Box<[u8]>, (u32, u32)>,
    cached_ids: Vec<u32>,
    enc: String,
    heap_syms: Vec<HeapSym>,
}

#[derive(Clone, Copy)]
struct HeapSym {
    id: u32,
    prev: u32,
    next: u32,
}

const NONE: u32 = u32::MAX;

/// A queued merge: (rank, left index, right index, left id, right id); smallest pops first.
type QueuedPair = (u32, u32, u32, u32, u32);

/// Words at most this long are cached and merged by a linear scan; longer ones use a heap.
const SHORT_WORD: usize = 48;

#[inline]
fn key(a: u32, b: u32) -> u64 {
    (a as u64) << 32 | b as u64
}

impl Bpe {
    pub(crate) fn new(
        pre: PreTokenizer,
        ignore_merges: bool,
        texts: &[String],
        token_to_id: &FxHashMap<String, u32>,
        merges_src: &[String],
    ) -> Bpe {
        let n_vocab = texts.len() as u32;
        let mut extra: Vec<String> = Vec::new();
        let mut extra_ids: FxHashMap<String, u32> = FxHashMap::default();
        let mut sym_of = |s: &str, extra: &mut Vec<String>| -> u32 {
            if let Some(&id) = token_to_id.get(s) {
                return id;
            }
            if let Some(&id) = extra_ids.get(s) {
                return id;
            }
            let id = n_vocab + extra.len() as u32;
            extra.push(s.to_string());
            extra_ids.insert(s.to_string(), id);
            id
        };
        let byte_char = unicode::byte_to_char();
        let mut byte_sym = [0u32; 256];
        for b in 0..256 {
            byte_sym[b] = sym_of(byte_char[b].encode_utf8(&mut [0; 4]), &mut extra);
        }
        let mut merges = FxHashMap::default();
        merges.reserve(merges_src.len());
        for (rank, m) in merges_src.iter().enumerate() {
            // split at the first space after the first byte, as llama.cpp
            let (l, r) = match m.as_bytes().iter().skip(1).position(|&b| b == b' ') {
                Some(p) => (&m[..p + 1], &m[p + 2..]),
                None => ("", ""),
            };
            let li = sym_of(l, &mut extra);
            let ri = sym_of(r, &mut extra);
            let joined = format!("{l}{r}");
            let mi = sym_of(&joined, &mut extra);
            merges.entry(key(li, ri)).or_insert((rank as u32, mi));
        }
        let mut single_byte_token = [None; 256];
        for (b, slot) in single_byte_token.iter_mut().enumerate().take(128) {
            let s = (b as u8 as char).to_string();
            *slot = token_to_id.get(&s).copied();
        }
        Bpe {
            pre,
            ignore_merges,
            n_vocab,
            byte_sym,
            byte_char,
            char_byte: unicode::char_to_byte(),
            merges,
            extra,
            single_byte_token,
        }
    }

    /// A normal token's text mapped back from GPT-2's alphabet to bytes (llama.cpp's
    /// `llama_decode_text`, with its `[UNK_BYTE_..]` for characters outside the alphabet).
    pub(crate) fn decode_text(&self, text: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(text.len());
        for c in text.chars() {
            match self.char_byte.get(c as usize).copied().flatten() {
                Some(b) => out.push(b),
                None => {
                    out.extend_from_slice(b"[UNK_BYTE_0x");
                    for b in c.encode_utf8(&mut [0; 4]).bytes() {
                        out.extend_from_slice(format!("{b:02x}").as_bytes());
                    }
                    out.extend_from_slice(text.as_bytes());
                    out.push(b']');
                }
            }
        }
        out
    }

    /// Tokenizes one text fragment (no special tokens in it).
    pub(crate) fn encode(&self, tok: &Tokenizer, text: &str, s: &mut Session, out: &mut Vec<u32>) {
        let mut words = std::mem::take(&mut s.words);
        self.pre.split(text, &mut words);
        for &(a, b) in &words {
            let w = &text.as_bytes()[a..b];
            if w.len() <= SHORT_WORD {
                if let Some(&(start, len)) = s.cache.get(w) {
                    out.extend_from_slice(&s.cached_ids[start as usize..(start + len) as usize]);
                    continue;
                }
                let start = out.len();
                self.encode_word(tok, w, s, out);
                let cstart = s.cached_ids.len() as u32;
                s.cached_ids.extend_from_slice(&out[start..]);
                s.cache
                    .insert(w.into(), (cstart, (out.len() - start) as u32));
            } else {
                self.encode_word(tok, w, s, out);
            }
        }
        s.words = words;
    }

    fn encode_word(&self, tok: &Tokenizer, w: &[u8], s: &mut Session, out: &mut Vec<u32>) {
        if self.ignore_merges {
            s.enc.clear();
            s.enc.extend(w.iter().map(|&b| self.byte_char[b as usize]));
            if let Some(&id) = tok.token_to_id.get(s.enc.as_str()) {
                out.push(id);
                return;
            }
        }
        if w.len() <= SHORT_WORD {
            let syms = &mut s.syms;
            syms.clear();
            syms.extend(w.iter().map(|&b| self.byte_sym[b as usize]));
            loop {
                let mut best: Option<(u32, usize, u32)> = None;
                for i in 0..syms.len().saturating_sub(1) {
                    if let Some(&(rank, merged)) = self.merges.get(&key(syms[i], syms[i + 1])) {
                        if best.is_none_or(|(r, _, _)| rank < r) {
                            best = Some((rank, i, merged));
                        }
                    }
                }
                let Some((_, i, merged)) = best else { break };
                syms[i] = merged;
                syms.remove(i + 1);
            }
            for k in 0..s.syms.len() {
                self.emit(s.syms[k], out);
            }
        } else {
            self.encode_long(w, s, out);
        }
    }

    /// The heap version for long words: O(n log n).
    fn encode_long(&self, w: &[u8], s: &mut Session, out: &mut Vec<u32>) {
        let n = w.len();
        let syms = &mut s.heap_syms;
        syms.clear();
        for (i, &b) in w.iter().enumerate() {
            syms.push(HeapSym {
                id: self.byte_sym[b as usize],
                prev: if i == 0 { NONE } else { i as u32 - 1 },
                next: if i + 1 == n { NONE } else { i as u32 + 1 },
            });
        }
        let mut heap: BinaryHeap<Reverse<QueuedPair>> = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[HeapSym], l: u32, r: u32| {
            if l == NONE || r == NONE {
                return;
            }
            let (li, ri) = (syms[l as usize].id, syms[r as usize].id);
            if let Some(&(rank, _)) = self.merges.get(&key(li, ri)) {
                heap.push(Reverse((rank, l, r, li, ri)));
            }
        };
        for i in 1..n as u32 {
            push(&mut heap, syms, i - 1, i);
        }
        while let Some(Reverse((_, l, r, li, ri))) = heap.pop() {
            let (ls, rs) = (syms[l as usize], syms[r as usize]);
            if ls.id != li || rs.id != ri || ls.next != r {
                continue; // stale: one side changed since the pair was queued
            }
            let merged = self.merges[&key(li, ri)].1;
            syms[l as usize].id = merged;
            syms[l as usize].next = rs.next;
            syms[r as usize].id = NONE;
            if rs.next != NONE {
                syms[rs.next as usize].prev = l;
            }
            let prev = syms[l as usize].prev;
            push(&mut heap, syms, prev, l);
            push(&mut heap, syms, l, rs.next);
        }
        let mut i = 0u32;
        while i != NONE {
            let sym = s.heap_syms[i as usize];
            self.emit(sym.id, out);
            i = sym.next;
        }
    }

    /// A final symbol: its token, or the tokens of its single bytes when it is not a token.
    #[inline]
    fn emit(&self, id: u32, out: &mut Vec<u32>) {
        if id < self.n_vocab {
            out.push(id);
            return;
        }
        for b in self.extra[(id - self.n_vocab) as usize].bytes() {
            if let Some(t) = self.single_byte_token[b as usize] {
                out.push(t);
            }
        }
    }
}
