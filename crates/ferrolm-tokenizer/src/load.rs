//! Building a [`Tokenizer`] from GGUF metadata, following llama.cpp's `llama_vocab::impl::load`.

use aho_corasick::AhoCorasick;
use ferrolm_gguf::{Array, Metadata, Value};
use rustc_hash::FxHashMap;

use crate::pretok::{pre_spec, PreTokenizer};
use crate::*;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

// Texts that llama.cpp takes for end-of-turn, end-of-message, FIM and end-of-generation tokens
// when the metadata does not name them.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// A token id from the metadata, if present and in range (llama.cpp keeps the default otherwise).
fn opt_id(
    meta: &Metadata,
    key: &str,
    n: usize,
    default: Option<u32>,
) -> Result<Option<u32>, TokenizerError> {
    let default = default.filter(|&d| (d as usize) < n);
    Ok(match meta.opt_u32(key)? {
        Some(id) if (id as usize) < n => Some(id),
        _ => default,
    })
}

pub(crate) fn load(meta: &Metadata) -> Result<Tokenizer, TokenizerError> {
    let model_name = meta
        .opt_str(KEY_MODEL)?
        .ok_or_else(|| TokenizerError::MissingKey(KEY_MODEL.into()))?
        .to_string();
    let is_bpe = match model_name.as_str() {
        "gpt2" => true,
        "llama" => false,
        other => return Err(TokenizerError::UnknownVocabType(other.to_string())),
    };
    let pre_name = meta.opt_str(KEY_PRE)?.map(str::to_string);

    // Per-type defaults, then the pre-tokenizer's.
    let (mut bos, mut eos, mut unk) = if is_bpe {
        (Some(11), Some(11), None)
    } else {
        (Some(1), Some(2), Some(0))
    };
    let mut add_bos = !is_bpe;
    let mut add_space_prefix = !is_bpe;
    let mut clean_spaces = is_bpe;
    let mut spec = None;
    if is_bpe {
        let name = pre_name
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or("default");
        let s =
            pre_spec(name).ok_or_else(|| TokenizerError::UnknownPreTokenizer(name.to_string()))?;
        add_bos = s.add_bos;
        clean_spaces = s.clean_spaces;
        if s.no_bos {
            bos = None;
        }
        spec = Some(s);
    }
    if let Some(v) = meta.opt_bool("tokenizer.ggml.add_space_prefix")? {
        add_space_prefix = v;
    }

    let texts_raw = meta
        .opt_array(KEY_TOKENS)?
        .ok_or_else(|| TokenizerError::MissingKey(KEY_TOKENS.into()))?;
    let Array::String(texts_raw) = texts_raw else {
        return Err(TokenizerError::Invalid(format!(
            "{KEY_TOKENS} is not an array of strings"
        )));
    };
    let n = texts_raw.len();
    if n == 0 {
        return Err(TokenizerError::Invalid(format!("{KEY_TOKENS} is empty")));
    }
    if n > u32::MAX as usize / 2 {
        return Err(TokenizerError::Invalid(format!("{n} tokens is too many")));
    }
    let texts: Vec<String> = texts_raw
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.clone()
            }
        })
        .collect();

    let scores: Vec<f32> = match meta.get(KEY_SCORES) {
        None => vec![0.0; n],
        Some(Value::Array(Array::F32(v))) => v.clone(),
        Some(Value::Array(Array::I32(v))) => v.iter().map(|&x| x as f32).collect(),
        Some(_) => {
            return Err(TokenizerError::Invalid(format!(
                "{KEY_SCORES} must be an array of f32 or i32"
            )))
        }
    };
    if scores.len() < n {
        return Err(TokenizerError::Invalid(format!(
            "{KEY_SCORES} has {} entries for {n} tokens",
            scores.len()
        )));
    }
    let mut attrs = vec![ATTR_NORMAL; n];
    if meta.contains(KEY_TYPES) {
        let types = meta.get_int_array(KEY_TYPES)?;
        if types.len() < n {
            return Err(TokenizerError::Invalid(format!(
                "{KEY_TYPES} has {} entries for {n} tokens",
                types.len()
            )));
        }
        for (a, &t) in attrs.iter_mut().zip(&types) {
            *a = match t {
                1 => ATTR_NORMAL,
                2 => ATTR_UNKNOWN,
                3 => ATTR_CONTROL,
                4 => ATTR_USER_DEFINED,
                5 => ATTR_UNUSED,
                6 => ATTR_BYTE,
                _ => 0,
            };
        }
    }
    let mut token_to_id: FxHashMap<String, u32> = FxHashMap::default();
    token_to_id.reserve(n);
    for (i, t) in texts.iter().enumerate() {
        token_to_id.insert(t.clone(), i as u32);
    }

    // Special token ids: defaults, overridden by in-range metadata.
    bos = opt_id(meta, "tokenizer.ggml.bos_token_id", n, bos)?;
    eos = opt_id(meta, "tokenizer.ggml.eos_token_id", n, eos)?;
    unk = opt_id(meta, "tokenizer.ggml.unknown_token_id", n, unk)?;
    let _ = unk;
    let mut eot = opt_id(meta, "tokenizer.ggml.eot_token_id", n, None)?;
    let mut eom = opt_id(meta, "tokenizer.ggml.eom_token_id", n, None)?;
    let mut fim_pre = opt_id(meta, "tokenizer.ggml.fim_pre_token_id", n, None)?;
    let mut fim_suf = opt_id(meta, "tokenizer.ggml.fim_suf_token_id", n, None)?;
    let mut fim_mid = opt_id(meta, "tokenizer.ggml.fim_mid_token_id", n, None)?;
    let mut fim_pad = opt_id(meta, "tokenizer.ggml.fim_pad_token_id", n, None)?;
    let mut fim_rep = opt_id(meta, "tokenizer.ggml.fim_rep_token_id", n, None)?;
    let mut fim_sep = opt_id(meta, "tokenizer.ggml.fim_sep_token_id", n, None)?;
    fim_pre = opt_id(meta, "tokenizer.ggml.prefix_token_id", n, fim_pre)?;
    fim_suf = opt_id(meta, "tokenizer.ggml.suffix_token_id", n, fim_suf)?;
    fim_mid = opt_id(meta, "tokenizer.ggml.middle_token_id", n, fim_mid)?;

    if let Some(v) = meta.opt_bool("tokenizer.ggml.add_bos_token")? {
        add_bos = v;
    }
    let add_eos = meta
        .opt_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);

    // Find unnamed special tokens by their text (in id order), and make them control tokens.
    for (i, t) in texts.iter().enumerate() {
        let i = i as u32;
        for (slot, list) in [
            (&mut eot, EOT_TEXTS),
            (&mut eom, EOM_TEXTS),
            (&mut fim_pre, FIM_PRE_TEXTS),
            (&mut fim_suf, FIM_SUF_TEXTS),
            (&mut fim_mid, FIM_MID_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() && list.contains(&t.as_str()) {
                *slot = Some(i);
                attrs[i as usize] |= ATTR_CONTROL;
            }
        }
    }
    // Control tokens named "unused" are unused.
    for (a, t) in attrs.iter_mut().zip(&texts) {
        if *a & ATTR_CONTROL != 0 && t.contains("unused") {
            *a |= ATTR_UNUSED;
        }
    }
    let mut eog: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
    for (i, t) in texts.iter().enumerate() {
        if EOG_TEXTS.contains(&t.as_str()) {
            eog.push(i as u32);
            attrs[i] |= ATTR_CONTROL;
        }
    }
    for (i, t) in texts.iter().enumerate() {
        if matches!(
            t.as_str(),
            "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
        ) {
            attrs[i] = ATTR_USER_DEFINED;
        }
    }
    eog.extend([eos, eot, eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();
    let has = |eog: &[u32], s: &str| eog.iter().find(|&&id| texts[id as usize] == s).copied();
    // gpt-oss / solar-open: "<|end|>" ends a message, not the generation.
    if let Some(end) = has(&eog, "<|end|>") {
        let call = has(&eog, "<|call|>").is_some() || has(&eog, "<|calls|>").is_some();
        if call && (has(&eog, "<|return|>").is_some() || has(&eog, "<|flush|>").is_some()) {
            eog.retain(|&id| id != end);
            attrs[end as usize] = ATTR_USER_DEFINED;
        }
    }
    // gemma4 and plamo have a normal "</s>".
    if let Some(s) = has(&eog, "</s>") {
        if has(&eog, "<|tool_response>").is_some() || has(&eog, "<|plamo:eos|>").is_some() {
            eog.retain(|&id| id != s);
            attrs[s as usize] = ATTR_NORMAL;
        }
    }

    let mut specials: Vec<u32> = (0..n as u32)
        .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
        .collect();
    specials.sort_by(|&a, &b| texts[b as usize].len().cmp(&texts[a as usize].len()));

    // Per-model attributes, as llama.cpp sets them after the caches.
    let general_name = meta
        .opt_str("general.name")
        .ok()
        .flatten()
        .unwrap_or("")
        .to_lowercase();
    if general_name.contains("phi-3") || general_name.contains("phi3") {
        for &id in &specials {
            attrs[id as usize] |= ATTR_RSTRIP;
        }
        if let Some(&id) = token_to_id.get("</s>") {
            attrs[id as usize] |= ATTR_RSTRIP;
        }
        for t in ["<unk>", "<s>", "<|endoftext|>"] {
            if let Some(&id) = token_to_id.get(t) {
                attrs[id as usize] &= !ATTR_RSTRIP;
            }
        }
    }

    let special_finder = if specials.is_empty() {
        None
    } else {
        let pats: Vec<&str> = specials
            .iter()
            .map(|&i| texts[i as usize].as_str())
            .collect();
        Some(
            AhoCorasick::new(&pats)
                .map_err(|e| TokenizerError::Invalid(format!("special tokens: {e}")))?,
        )
    };

    let model = if is_bpe {
        let spec = spec.expect("set for BPE");
        let merges = match meta.opt_array(KEY_MERGES)? {
            Some(Array::String(m)) => m.as_slice(),
            Some(_) => {
                return Err(TokenizerError::Invalid(format!(
                    "{KEY_MERGES} is not an array of strings"
                )))
            }
            None => return Err(TokenizerError::MissingKey(KEY_MERGES.into())),
        };
        let pre = PreTokenizer::new(spec.regexes)?;
        Model::Bpe(Box::new(bpe::Bpe::new(
            pre,
            spec.ignore_merges,
            &texts,
            &token_to_id,
            merges,
        )))
    } else {
        Model::Spm
    };

    let mut tok = Tokenizer {
        model,
        model_name,
        pre_name,
        texts,
        scores,
        attrs,
        token_to_id,
        pieces: Vec::new(),
        bos,
        eos,
        add_bos,
        add_eos,
        add_space_prefix,
        clean_spaces,
        specials,
        special_finder,
        eog,
        chat_template: meta.opt_str("tokenizer.chat_template")?.map(str::to_string),
        byte_tokens: [None; 256],
    };
    for b in 0..=255u8 {
        let hex = format!("<0x{b:02X}>");
        tok.byte_tokens[b as usize] = tok.token_to_id.get(hex.as_str()).copied().or_else(|| {
            (b < 0x80)
                .then(|| {
                    tok.token_to_id
                        .get((b as char).to_string().as_str())
                        .copied()
                })
                .flatten()
        });
    }
    tok.pieces = (0..n as u32).map(|id| piece_of(&tok, id)).collect();
    Ok(tok)
}

/// `token_to_piece(special = true)` without the cache.
fn piece_of(tok: &Tokenizer, id: u32) -> Vec<u8> {
    let attr = tok.attrs[id as usize];
    let text = tok.texts[id as usize].as_str();
    if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
        return text.as_bytes().to_vec();
    }
    if attr & ATTR_NORMAL != 0 {
        return match &tok.model {
            Model::Spm => text.replace('\u{2581}', " ").into_bytes(),
            Model::Bpe(b) => b.decode_text(text),
        };
    }
    if attr & ATTR_BYTE != 0 {
        // "<0xXX>"; strtol of the two hex digits (0 when they are not hex)
        let hex = text.get(3..5).unwrap_or("");
        let mut v: u32 = 0;
        for c in hex.chars() {
            match c.to_digit(16) {
                Some(d) => v = v * 16 + d,
                None => break,
            }
        }
        return vec![v as u8];
    }
    Vec::new()
}
