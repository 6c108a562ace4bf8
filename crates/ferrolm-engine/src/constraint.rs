//! Constrained decoding: a grammar (a JSON schema, or a Lark grammar) that every generated
//! token must keep satisfiable, enforced by llguidance. Before each sampling, the tokens that
//! would break the grammar get a logit of minus infinity; each sampled token advances the
//! grammar's parser. A [`Constraints`] is built once per tokenizer (its token trie); each
//! request gets its own [`Constraint`].

use std::sync::{mpsc, Arc};

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
        Ok(Constraint::start(matcher, self.eog.clone()))
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

/// The next mask, computed by the worker, or the grammar's failure.
type NextMask = Result<Mask, String>;

/// Which tokens may come next.
struct Mask {
    allowed: SimpleVob,
    /// The grammar has ended: nothing but the end may come.
    stopped: bool,
}

/// One request's grammar state. Its matcher lives on a worker thread that computes the next
/// mask as soon as a token is accepted, while the next forward pass runs: sampling then only
/// waits for a mask that is usually ready.
pub struct Constraint {
    tokens: mpsc::Sender<u32>,
    masks: mpsc::Receiver<NextMask>,
    /// The mask for the next sampling, once received.
    next: Option<Mask>,
    eog: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").finish_non_exhaustive()
    }
}

/// The worker: a mask now, then one after each token, until the constraint is dropped.
fn run_matcher(mut matcher: Matcher, tokens: mpsc::Receiver<u32>, masks: mpsc::Sender<NextMask>) {
    loop {
        let mask = matcher
            .compute_mask_or_eos()
            .map(|allowed| Mask {
                allowed,
                stopped: matcher.is_stopped(),
            })
            .map_err(|e| e.to_string());
        let failed = mask.is_err();
        if masks.send(mask).is_err() || failed {
            return;
        }
        let Ok(token) = tokens.recv() else {
            return;
        };
        if let Err(e) = matcher.consume_token(token) {
            let _ = masks.send(Err(e.to_string()));
            return;
        }
    }
}

impl Constraint {
    fn start(matcher: Matcher, eog: Vec<u32>) -> Constraint {
        let (tokens, token_rx) = mpsc::channel();
        let (mask_tx, masks) = mpsc::channel();
        // Should the thread not start, the first mask reports it.
        let spawned = std::thread::Builder::new()
            .name("ferrolm-grammar".into())
            .spawn(move || run_matcher(matcher, token_rx, mask_tx));
        let (tokens, masks) = match spawned {
            Ok(_) => (tokens, masks),
            Err(e) => {
                let (tx, rx) = mpsc::channel();
                let _ = tx.send(Err(format!("starting the grammar's thread: {e}")));
                (tokens, rx)
            }
        };
        Constraint {
            tokens,
            masks,
            next: None,
            eog,
        }
    }

    /// Waits for the next mask (computed since the last token).
    fn next_mask(&mut self) -> Result<&Mask, String> {
        if self.next.is_none() {
            let mask = self
                .masks
                .recv()
                .map_err(|_| "the grammar's thread ended".to_string())??;
            self.next = Some(mask);
        }
        Ok(self.next.as_ref().expect("set above"))
    }

    /// Whether the grammar has ended: the sequence ends without sampling.
    pub fn is_done(&mut self) -> Result<bool, String> {
        Ok(self.next_mask()?.stopped)
    }

    /// `logits` with every token the grammar forbids at minus infinity (any end-of-generation
    /// token is allowed where the grammar may end).
    pub fn mask(&mut self, logits: &[f32]) -> Result<Vec<f32>, String> {
        let eog = self.eog.clone();
        let mask = self.next_mask()?;
        let may_end = eog.iter().any(|&id| allowed(&mask.allowed, id));
        Ok(logits
            .iter()
            .enumerate()
            .map(|(id, &l)| {
                let id = id as u32;
                if allowed(&mask.allowed, id) || (may_end && eog.contains(&id)) {
                    l
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect())
    }

    /// Whether `id` passes the current mask.
    pub fn allows(&mut self, id: u32) -> Result<bool, String> {
        let eog = self.eog.clone();
        let mask = self.next_mask()?;
        Ok(allowed(&mask.allowed, id)
            || (eog.contains(&id) && eog.iter().any(|&e| allowed(&mask.allowed, e))))
    }

    /// Advances the grammar over a sampled token (an end-of-generation token ends it); the
    /// worker starts on the next mask at once.
    pub fn accept(&mut self, id: u32) -> Result<(), String> {
        self.next = None;
        if self.eog.contains(&id) {
            return Ok(());
        }
        self.tokens
            .send(id)
            .map_err(|_| "the grammar's thread ended".to_string())
    }
}

fn allowed(mask: &SimpleVob, id: u32) -> bool {
    (id as usize) < mask.len() && mask.is_allowed(id)
}
