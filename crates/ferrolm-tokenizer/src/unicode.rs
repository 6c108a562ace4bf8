//! Code point classes as llama.cpp sees them (Unicode 15.1 general categories, White_Space),
//! and the GPT-2 byte-to-character map of byte-level BPE.

use std::sync::OnceLock;

use crate::unicode_table::CATEGORY_RUNS;

/// Class bits (low three) of a flags byte.
pub(crate) const CLASS_MASK: u8 = 0b111;
/// Unassigned code point.
#[cfg(test)]
pub(crate) const UNDEFINED: u8 = 0;
/// `\p{N}`.
pub(crate) const NUMBER: u8 = 1;
/// `\p{L}`.
pub(crate) const LETTER: u8 = 2;
/// `\p{M}`.
pub(crate) const MARK: u8 = 4;
/// `\p{P}`.
pub(crate) const PUNCTUATION: u8 = 5;
/// `\p{S}`.
pub(crate) const SYMBOL: u8 = 6;
/// White_Space property (`\s`).
pub(crate) const WHITESPACE: u8 = 1 << 3;
/// Set for every code point in range; a position outside the fragment has flags 0.
pub(crate) const VALID: u8 = 1 << 4;

/// One flags byte per code point (1.1 MB, built once).
pub(crate) fn table() -> &'static [u8] {
    static TABLE: OnceLock<Vec<u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![0u8; 0x110000];
        for (i, &(start, class)) in CATEGORY_RUNS.iter().enumerate() {
            let end = CATEGORY_RUNS.get(i + 1).map_or(0x110000, |r| r.0);
            for f in &mut t[start as usize..end as usize] {
                *f = class | VALID;
            }
        }
        for (cp, f) in t.iter_mut().enumerate() {
            if char::from_u32(cp as u32).is_some_and(char::is_whitespace) {
                *f |= WHITESPACE;
            }
        }
        t
    })
}

/// Flags of a code point, from a table obtained with [`table`].
#[inline]
pub(crate) fn flags_of(t: &[u8], c: char) -> u8 {
    t[c as usize]
}

/// The class (low bits) of a flags byte.
#[inline]
pub(crate) fn class(f: u8) -> u8 {
    f & CLASS_MASK
}

#[inline]
pub(crate) fn is_letter(f: u8) -> bool {
    f & VALID != 0 && class(f) == LETTER
}

#[inline]
pub(crate) fn is_number(f: u8) -> bool {
    f & VALID != 0 && class(f) == NUMBER
}

#[inline]
pub(crate) fn is_whitespace(f: u8) -> bool {
    f & WHITESPACE != 0
}

/// GPT-2's byte-level alphabet: the character that stands for each byte.
pub(crate) fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut taken = [false; 256];
    for b in (0x21..=0x7Eu32).chain(0xA1..=0xAC).chain(0xAE..=0xFF) {
        map[b as usize] = char::from_u32(b).expect("latin-1");
        taken[b as usize] = true;
    }
    let mut n = 0u32;
    for b in 0..256usize {
        if !taken[b] {
            map[b] = char::from_u32(256 + n).expect("small code point");
            n += 1;
        }
    }
    map
}

/// The inverse of [`byte_to_char`], indexed by code point (all are below 0x144).
pub(crate) fn char_to_byte() -> Vec<Option<u8>> {
    let mut inv = vec![None; 0x144];
    for (b, c) in byte_to_char().iter().enumerate() {
        inv[*c as usize] = Some(b as u8);
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_common_code_points() {
        let t = table();
        assert!(is_letter(flags_of(t, 'a')));
        assert!(is_letter(flags_of(t, 'é')));
        assert!(is_letter(flags_of(t, '你')));
        assert!(is_number(flags_of(t, '7')));
        assert!(is_number(flags_of(t, '½')));
        assert!(is_whitespace(flags_of(t, ' ')));
        assert!(is_whitespace(flags_of(t, '\u{3000}')));
        assert!(!is_whitespace(flags_of(t, '\u{1c}')));
        assert_eq!(class(flags_of(t, '!')), PUNCTUATION);
        assert_eq!(class(flags_of(t, '$')), SYMBOL);
        assert_eq!(class(flags_of(t, '\u{301}')), MARK);
        assert_eq!(class(flags_of(t, '\u{378}')), UNDEFINED);
        assert!(flags_of(t, '\u{378}') & VALID != 0);
    }

    #[test]
    fn byte_alphabet_round_trips() {
        let m = byte_to_char();
        let inv = char_to_byte();
        for b in 0..=255u8 {
            assert_eq!(inv[m[b as usize] as usize], Some(b));
        }
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(m[b'a' as usize], 'a');
    }
}
