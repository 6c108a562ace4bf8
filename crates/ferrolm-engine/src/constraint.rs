//! Constrained decoding: a grammar (a JSON schema, or a Lark grammar) that every generated
//! token must keep satisfiable, enforced by llguidance. Before each sampling, the tokens that
//! would break the grammar get a logit of minus infinity; each sampled token advances the
//! grammar's parser. A [`Constraints`] is built once per tokenizer (its token trie); each
//! request gets its own [`Constraint`].

use std::sync::Arc;

use ferrolm_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

/// The tokenizer as llguidance sees it: every token's bytes in a trie, special tokens behind
/// the marker byte so that grammar text never produces them.
struct TokenizerAdapter {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerAdapter {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false, false)
    }
}

/// Builds per-request constraints for one tokenizer.
pub struct Constraints {
    factory: ParserFactory,
    eog: Vec<u32>,
}

impl Constraints {
    /// Indexes the tokenizer's vocabulary (once: some tens of milliseconds for 50k tokens).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Constraints, String> {
        let n_vocab = tokenizer.vocab_size();
        let eog = tokenizer.eog_ids().to_vec();
        let eos = tokenizer
            .eos()
            .or_else(|| eog.first().copied())
            .ok_or("the vocabulary has no end-of-generation token to end a grammar with")?;
        let words: Vec<Vec<u8>> = (0..n_vocab as u32)
            .map(|id| {
                if tokenizer.is_special(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).unwrap_or("").as_bytes());
                    w
                } else {
                    tokenizer
                        .token_bytes(id, false)
                        .map(|b| b.into_owned())
                        .unwrap_or_default()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n_vocab as u32, eos);
        info.tok_bos = tokenizer.bos();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(TokenizerAdapter { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Warnings and errors come back to the request, not on stderr.
        factory.set_stderr_log_level(0);
        Ok(Constraints { factory, eog })
    }

    /// A fresh constraint for one request; an error names what in the grammar is wrong.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, String> {
        let top = match grammar {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            eog: self.eog.clone(),
        })
    }
}

/// A schema whose JSON is written on one line with `, ` and `: ` between items, unless the
/// schema says otherwise (llguidance's `x-guidance` options): llguidance's default allows any
/// whitespace between tokens, where a model can wander for ever.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    eog: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").finish_non_exhaustive()
    }
}

impl Constraint {
    /// `logits` with every token the grammar forbids at minus infinity (any end-of-generation
    /// token is allowed where the grammar may end), and the mask it applied.
    pub fn mask(&mut self, logits: &[f32]) -> Result<(Vec<f32>, SimpleVob), String> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let may_end = self.eog.iter().any(|&id| mask.is_allowed(id));
        let masked = logits
            .iter()
            .enumerate()
            .map(|(id, &l)| {
                let id = id as u32;
                let ok = (id as usize) < mask.len()
                    && (mask.is_allowed(id) || (may_end && self.eog.contains(&id)));
                if ok {
                    l
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Ok((masked, mask))
    }

    /// Whether `id` passes the mask [`Constraint::mask`] returned.
    pub fn allows(&self, mask: &SimpleVob, id: u32) -> bool {
        ((id as usize) < mask.len() && mask.is_allowed(id))
            || (self.eog.contains(&id) && self.eog.iter().any(|&e| mask.is_allowed(e)))
    }

    /// Advances the grammar over a sampled token (an end-of-generation token ends it).
    pub fn accept(&mut self, id: u32) -> Result<(), String> {
        if self.eog.contains(&id) {
            return Ok(());
        }
        self.matcher.consume_token(id).map_err(|e| e.to_string())
    }

    /// Whether the grammar admits nothing more: the sequence should end.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
