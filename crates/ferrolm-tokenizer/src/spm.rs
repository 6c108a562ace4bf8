//! SentencePiece (`tokenizer.ggml.model = llama`), as llama.cpp's `llm_tokenizer_spm_session`.
//!
//! The text (spaces already escaped as `▁`) starts as one symbol per character; the adjacent
//! pair whose concatenation is the token with the highest score merges first (leftmost among
//! equals). A final symbol that is not a token becomes byte tokens `<0xXX>`.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::Tokenizer;

#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    n: u32,
    prev: i32,
    next: i32,
}

struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    size: u32,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// Highest score first, then leftmost.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .partial_cmp(&o.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// Tokenizes an escaped text fragment into `out`.
pub(crate) fn encode(tok: &Tokenizer, text: &str, out: &mut Vec<u32>) {
    if text.is_empty() {
        return;
    }
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    let mut iter = text.char_indices().peekable();
    let mut idx = 0i32;
    while let Some((i, c)) = iter.next() {
        let last = iter.peek().is_none();
        syms.push(Sym {
            start: i as u32,
            n: c.len_utf8() as u32,
            prev: idx - 1,
            next: if last { -1 } else { idx + 1 },
        });
        idx += 1;
    }
    let mut heap = BinaryHeap::with_capacity(syms.len());
    let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: i32, r: i32| {
        if l < 0 || r < 0 {
            return;
        }
        let (ls, rs) = (syms[l as usize], syms[r as usize]);
        let s = &text[ls.start as usize..(rs.start + rs.n) as usize];
        if let Some(&id) = tok.token_to_id.get(s) {
            heap.push(Bigram {
                score: tok.scores[id as usize],
                left: l as u32,
                right: r as u32,
                size: s.len() as u32,
            });
        }
    };
    for i in 1..syms.len() as i32 {
        try_add(&mut heap, &syms, i - 1, i);
    }
    while let Some(bg) = heap.pop() {
        let (l, r) = (bg.left as usize, bg.right as usize);
        if syms[l].n == 0 || syms[r].n == 0 || syms[l].n + syms[r].n != bg.size {
            continue;
        }
        syms[l].n += syms[r].n;
        syms[r].n = 0;
        syms[l].next = syms[r].next;
        if syms[r].next >= 0 {
            let nx = syms[r].next as usize;
            syms[nx].prev = l as i32;
        }
        let prev = syms[l].prev;
        let next = syms[l].next;
        try_add(&mut heap, &syms, prev, l as i32);
        try_add(&mut heap, &syms, l as i32, next);
    }
    let mut i = 0i32;
    while i != -1 {
        let s = syms[i as usize];
        let piece = &text[s.start as usize..(s.start + s.n) as usize];
        match tok.token_to_id.get(piece) {
            Some(&id) => out.push(id),
            None => {
                for b in piece.bytes() {
                    if let Some(id) = tok.byte_tokens[b as usize] {
                        out.push(id);
                    }
                }
            }
        }
        i = s.next;
    }
}
