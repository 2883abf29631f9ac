//! Constrained decoding: generation that can only produce text a grammar accepts (OpenAI's
//! `response_format` `json_object` and `json_schema`). Built on llguidance (the constraint
//! engine vLLM, SGLang and llama.cpp use): before each token of a constrained sequence, the
//! sequence's matcher says which vocabulary tokens may come next, every other token's logit
//! becomes −∞, and the sampled token is fed back to the matcher. Once the grammar is complete
//! only end-of-sequence tokens are allowed, so the request ends with `stop`.
//!
//! The token set is computed on the host from the token sampled last, so a constrained sequence
//! is stepped with its previous token read first (the batch does not pipeline its steps while
//! one is running; see [`crate::engine::batch`]). So one constrained request makes every step
//! of its batch wait for the one before it, and each constrained row costs the host a token
//! mask per step.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use mlx_rs::Array;
use serde_json::{json, Value};

use crate::error::{EngineError, Result};

/// What a constrained request's output must be.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `{"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this JSON Schema (OpenAI's `json_schema`; draft 2020-12 as
    /// llguidance supports it: types, properties, required, enums, `$defs`/`$ref`, formats).
    JsonSchema(Value),
}

impl Grammar {
    /// The schema llguidance compiles. Unless the schema says otherwise (its `x-guidance`
    /// options), JSON is written with `", "` and `": "` and no other whitespace, so a model
    /// cannot spend its tokens on blank lines.
    fn schema(&self) -> Value {
        let mut schema = match self {
            Grammar::JsonObject => json!({"type": "object"}),
            Grammar::JsonSchema(schema) => schema.clone(),
        };
        if let Some(object) = schema.as_object_mut() {
            object.entry("x-guidance").or_insert_with(|| {
                json!({
                    "whitespace_flexible": false,
                    "item_separator": ", ",
                    "key_separator": ": ",
                })
            });
        }
        schema
    }
}

/// A tokenizer's vocabulary as llguidance sees it (each token's bytes), built once per model.
pub struct GrammarEnv {
    factory: ParserFactory,
}

impl GrammarEnv {
    /// From every token's bytes ([`token_bytes`]) and the end-of-sequence ids.
    pub fn new(words: &[Vec<u8>], eos_token_ids: &[u32]) -> Result<Self> {
        let invalid = |e: String| EngineError::Tokenizer(format!("constrained decoding: {e}"));
        let eos = *eos_token_ids
            .first()
            .ok_or_else(|| invalid("the tokenizer has no end-of-sequence token".into()))?;
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, words).with_eos_tokens(eos_token_ids);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| invalid(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A matcher at the start of `grammar`; an invalid schema is
    /// [`EngineError::InvalidGrammar`].
    pub(crate) fn start(&self, grammar: &Grammar) -> Result<GrammarState> {
        let top = TopLevelGrammar::from_json_schema(grammar.schema());
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| EngineError::InvalidGrammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(EngineError::InvalidGrammar(error));
        }
        Ok(GrammarState { matcher })
    }
}

/// Every token's bytes, from the tokenizer's `tokenizer.json` (as a string): byte-level BPE
/// tokens mapped back to their bytes, SentencePiece pieces with `▁` as a space and `<0xNN>` as
/// the byte; special tokens start with [`TokTrie::SPECIAL_TOKEN_MARKER`]. Tokenizers whose
/// token bytes cannot be recovered (neither byte-level nor with a byte fallback) are an error.
pub fn token_bytes(tokenizer_json: &str) -> std::result::Result<Vec<Vec<u8>>, String> {
    let parsed: Value = serde_json::from_str(tokenizer_json).map_err(|e| e.to_string())?;
    // llguidance asserts on malformed byte tokens (`<0x..>`); an untrusted tokenizer must not
    // take the engine down with it.
    std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&parsed))
        .map_err(|_| "tokenizer.json has malformed byte tokens".to_string())?
        .map_err(|e| e.to_string())
}

/// One sequence's place in its grammar.
pub(crate) struct GrammarState {
    matcher: Matcher,
}

impl GrammarState {
    /// The logit bias of the next token: `[1, vocab]` float32, 0 where the grammar allows the
    /// token and −∞ elsewhere (ids past the tokenizer's vocabulary are never allowed). A
    /// matcher in an error state (it cannot happen with tokens drawn from its own masks)
    /// allows end-of-sequence only, which ends the sequence.
    pub fn mask(&mut self, vocab: usize) -> Array {
        let mut bias = vec![f32::NEG_INFINITY; vocab];
        let allowed = self.matcher.compute_mask_or_eos().or_else(|_| {
            self.matcher
                .tok_env()
                .map(|env| env.tok_trie().eos_token_set())
        });
        if let Ok(allowed) = allowed {
            // Walks the set bits only (whole empty words are skipped).
            allowed.iter_set_entries(|id| {
                if let Some(slot) = bias.get_mut(id) {
                    *slot = 0.0;
                }
            });
        }
        Array::from_slice(&bias, &[1, vocab as i32])
    }

    /// Advances past `token`, the one sampled under the last mask.
    pub fn consume(&mut self, token: u32) {
        // An error leaves the matcher in its error state, which the next mask handles.
        let _ = self.matcher.consume_token(token);
    }
}
