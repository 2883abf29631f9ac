//! GGUF tokenizer metadata → `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`.
//!
//! GGUF keeps a tokenizer as arrays (`tokenizer.ggml.tokens`, `.merges`, `.token_type`) plus
//! the name of the llama.cpp pre-tokenizer (`tokenizer.ggml.pre`), whose split regexes live in
//! llama.cpp's `llama-vocab.cpp`. Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is
//! converted; the pipeline mirrors a Hugging Face byte-level BPE `tokenizer.json`: no
//! normalizer, a ByteLevel pre-tokenizer (optionally after a regex Split), a BPE model, a
//! ByteLevel decoder, and control tokens as special added tokens.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::sequence::Sequence as PostProcessorSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, PostProcessorWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};

use crate::reader::GgufFile;
use crate::GgufError;

/// Tokenizer models (`tokenizer.ggml.model`) that convert.
const SUPPORTED_MODELS: &[&str] = &["gpt2"];

/// Pre-tokenizer names (`tokenizer.ggml.pre`) that convert.
const SUPPORTED_PRE: &[&str] = &[
    "default",
    "gpt2",
    "smollm",
    "starcoder",
    "refact",
    "llama-bpe",
    "llama3",
    "llama-v3",
];

/// Llama 3's split regex (its `tokenizer.json`; llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// How a `tokenizer.ggml.pre` name splits text before byte-level BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreSplit {
    /// ByteLevel's built-in GPT-2 regex.
    Gpt2,
    /// Every digit on its own, then the GPT-2 regex (StarCoder-family vocabularies).
    DigitsThenGpt2,
    /// Llama 3's regex (digits in groups of up to three), then ByteLevel without its regex.
    Llama3,
}

fn pre_split(pre: &str) -> Result<PreSplit, GgufError> {
    match pre {
        // "smollm": llama.cpp splits digits individually for it, but SmolLM2's tokenizer.json as
        // published for MLX (mlx-community) uses the plain GPT-2 regex; we follow the published
        // tokenizer so imported models tokenize exactly like downloaded ones. ASCII digits give the
        // same ids either way (the vocabulary merges no digits); other numerals (e.g. " ½") differ.
        "default" | "gpt2" | "smollm" => Ok(PreSplit::Gpt2),
        "starcoder" | "refact" => Ok(PreSplit::DigitsThenGpt2),
        "llama-bpe" | "llama3" | "llama-v3" => Ok(PreSplit::Llama3),
        other => Err(GgufError::UnsupportedPreTokenizer {
            found: other.to_string(),
            supported: SUPPORTED_PRE,
        }),
    }
}

/// Special token ids from the GGUF (`tokenizer.ggml.*_token_id`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SpecialTokenIds {
    pub(crate) bos: Option<u32>,
    pub(crate) eos: Option<u32>,
    pub(crate) unk: Option<u32>,
    pub(crate) pad: Option<u32>,
    /// End-of-turn / end-of-message ids that also stop generation (Llama 3 `<|eot_id|>`).
    pub(crate) extra_eos: Vec<u32>,
}

impl SpecialTokenIds {
    /// `eos_token_id` as Hugging Face writes it: one id, or a list when several stop generation.
    pub(crate) fn eos_json(&self) -> Value {
        let mut ids: Vec<u32> = self.eos.into_iter().collect();
        for &id in &self.extra_eos {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        match ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        }
    }
}

/// Everything the importer writes about the tokenizer.
pub(crate) struct TokenizerFiles {
    pub(crate) tokenizer: Tokenizer,
    pub(crate) tokenizer_config: Value,
    pub(crate) generation_config: Value,
    pub(crate) chat_template: Option<String>,
    pub(crate) special_ids: SpecialTokenIds,
}

/// Builds the tokenizer files from GGUF metadata. `model_max_length` is the context length in
/// tokens.
///
/// Errors: [`GgufError::UnsupportedTokenizer`], [`GgufError::UnsupportedPreTokenizer`],
/// [`GgufError::MissingMetadata`] / [`GgufError::MetadataType`] for the tokenizer keys,
/// [`GgufError::InvalidVocabulary`], [`GgufError::Tokenizer`].
pub(crate) fn build_tokenizer(
    gguf: &GgufFile,
    model_max_length: u64,
) -> Result<TokenizerFiles, GgufError> {
    let model = gguf.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(GgufError::UnsupportedTokenizer {
            found: model.to_string(),
            supported: SUPPORTED_MODELS,
        });
    }
    let split = pre_split(gguf.opt_str("tokenizer.ggml.pre")?.unwrap_or("default"))?;
    let tokens = gguf.str_array("tokenizer.ggml.tokens")?;
    let token_types = match gguf.get("tokenizer.ggml.token_type") {
        Some(_) => gguf.int_array("tokenizer.ggml.token_type")?,
        None => vec![1; tokens.len()],
    };
    if token_types.len() != tokens.len() {
        return Err(GgufError::InvalidVocabulary {
            reason: format!(
                "{} token types for {} tokens",
                token_types.len(),
                tokens.len()
            ),
        });
    }

    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, &token) in tokens.iter().enumerate() {
        let id = u32::try_from(id).map_err(|_| GgufError::InvalidVocabulary {
            reason: "more than 2^32 tokens".into(),
        })?;
        if let Some(previous) = vocab.insert(token.to_string(), id) {
            return Err(GgufError::InvalidVocabulary {
                reason: format!("token {token:?} appears twice (ids {previous} and {id})"),
            });
        }
    }
    let merges = gguf
        .str_array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, merge)| {
            merge
                .split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| GgufError::InvalidVocabulary {
                    reason: format!("merge #{i} {merge:?} is not two tokens separated by a space"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        // Llama 3 looks a whole pre-token up in the vocabulary before merging (its tokenizer.json
        // sets `ignore_merges`); GPT-2-style vocabularies always merge.
        .ignore_merges(split == PreSplit::Llama3)
        .build()
        .map_err(|e| GgufError::InvalidVocabulary {
            reason: e.to_string(),
        })?;

    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(split)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

    let special_ids = special_token_ids(gguf, tokens.len())?;
    let add_bos = gguf
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let add_eos = gguf
        .opt_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    tokenizer.with_post_processor(Some(post_processor(
        &tokens,
        &special_ids,
        add_bos,
        add_eos,
    )?));

    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for (&token, &token_type) in tokens.iter().zip(&token_types) {
        // Matched verbatim in the raw text, never split, never normalized.
        let added = |is_special: bool| {
            AddedToken::from(token, is_special)
                .single_word(false)
                .lstrip(false)
                .rstrip(false)
                .normalized(false)
        };
        match token_type {
            TOKEN_TYPE_CONTROL => special.push(added(true)),
            TOKEN_TYPE_USER_DEFINED => user_defined.push(added(false)),
            _ => {}
        }
    }
    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&user_defined);

    let chat_template = gguf.opt_str("tokenizer.chat_template")?.map(str::to_string);
    let token_text = |id: Option<u32>| id.map(|id| json!(tokens[id as usize]));
    // Sorted keys whatever serde_json's features, so the files are reproducible.
    let mut config: BTreeMap<String, Value> = BTreeMap::new();
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    config.insert("add_prefix_space".into(), json!(false));
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    config.insert("model_max_length".into(), json!(model_max_length));
    // The generic class loads tokenizer.json as written, in every transformers version.
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    for (key, id) in [
        ("bos_token", special_ids.bos),
        ("eos_token", special_ids.eos),
        ("unk_token", special_ids.unk),
        ("pad_token", special_ids.pad),
    ] {
        if let Some(text) = token_text(id) {
            config.insert(key.into(), text);
        }
    }
    if let Some(template) = &chat_template {
        config.insert("chat_template".into(), json!(template));
    }

    let mut generation: BTreeMap<String, Value> = BTreeMap::new();
    if let Some(bos) = special_ids.bos {
        generation.insert("bos_token_id".into(), json!(bos));
    }
    if !special_ids.eos_json().is_null() {
        generation.insert("eos_token_id".into(), special_ids.eos_json());
    }
    if let Some(pad) = special_ids.pad {
        generation.insert("pad_token_id".into(), json!(pad));
    }

    Ok(TokenizerFiles {
        tokenizer,
        tokenizer_config: json!(config),
        generation_config: json!(generation),
        chat_template,
        special_ids,
    })
}

fn pre_tokenizer(split: PreSplit) -> Result<PreTokenizerWrapper, GgufError> {
    // Flags as Hugging Face writes them for byte-level BPE: no prefix space, offsets trimmed.
    let byte_level =
        |use_regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    Ok(match split {
        PreSplit::Gpt2 => byte_level(true),
        PreSplit::DigitsThenGpt2 => PreTokenizerSequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])
        .into(),
        PreSplit::Llama3 => {
            let regex = Split::new(
                SplitPattern::Regex(LLAMA3_SPLIT_REGEX.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|source| GgufError::Tokenizer { source })?;
            PreTokenizerSequence::new(vec![regex.into(), byte_level(false)]).into()
        }
    })
}

/// ByteLevel offsets handling, plus BOS/EOS insertion when the GGUF asks for it
/// (`tokenizer.ggml.add_bos_token`), as Llama 3's tokenizer.json does with a template.
fn post_processor(
    tokens: &[&str],
    ids: &SpecialTokenIds,
    add_bos: bool,
    add_eos: bool,
) -> Result<PostProcessorWrapper, GgufError> {
    let byte_level = PostProcessorWrapper::ByteLevel(ByteLevel::new(true, false, true));
    let bos = ids
        .bos
        .filter(|_| add_bos)
        .map(|id| (tokens[id as usize].to_string(), id));
    let eos = ids
        .eos
        .filter(|_| add_eos)
        .map(|id| (tokens[id as usize].to_string(), id));
    if bos.is_none() && eos.is_none() {
        return Ok(byte_level);
    }
    let piece = |special: &Option<(String, u32)>, type_id: u32| {
        special
            .as_ref()
            .map(|(text, _)| format!("{text}:{type_id}"))
    };
    let single: Vec<String> = [piece(&bos, 0), Some("$A:0".into()), piece(&eos, 0)]
        .into_iter()
        .flatten()
        .collect();
    let pair: Vec<String> = [
        piece(&bos, 0),
        Some("$A:0".into()),
        piece(&eos, 0),
        piece(&bos, 1),
        Some("$B:1".into()),
        piece(&eos, 1),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut special_tokens: Vec<(String, u32)> = bos.into_iter().chain(eos).collect();
    special_tokens.dedup();
    let tokenizer_error = |e: String| GgufError::Tokenizer { source: e.into() };
    let template = TemplateProcessing::builder()
        .try_single(single)
        .map_err(tokenizer_error)?
        .try_pair(pair)
        .map_err(tokenizer_error)?
        .special_tokens(special_tokens)
        .build()
        .map_err(|e| tokenizer_error(e.to_string()))?;
    Ok(PostProcessorSequence::new(vec![byte_level, template.into()]).into())
}

fn special_token_ids(gguf: &GgufFile, n_tokens: usize) -> Result<SpecialTokenIds, GgufError> {
    let id = |key: &str| -> Result<Option<u32>, GgufError> {
        match gguf.opt_u64(key)? {
            None => Ok(None),
            Some(id) if id < n_tokens as u64 => Ok(Some(id as u32)),
            Some(id) => Err(GgufError::InvalidVocabulary {
                reason: format!("`{key}` is {id} but the vocabulary has {n_tokens} tokens"),
            }),
        }
    };
    Ok(SpecialTokenIds {
        bos: id("tokenizer.ggml.bos_token_id")?,
        eos: id("tokenizer.ggml.eos_token_id")?,
        unk: id("tokenizer.ggml.unknown_token_id")?,
        pad: id("tokenizer.ggml.padding_token_id")?,
        extra_eos: [
            id("tokenizer.ggml.eot_token_id")?,
            id("tokenizer.ggml.eom_token_id")?,
        ]
        .into_iter()
        .flatten()
        .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::MetadataValue;
    use crate::test_gguf::GgufBuilder;

    fn strings(items: &[&str]) -> MetadataValue {
        MetadataValue::Array(
            items
                .iter()
                .map(|s| MetadataValue::String(s.to_string()))
                .collect(),
        )
    }

    /// A byte-level vocabulary of the printable ASCII letters a, b, c plus "ab" and a control token.
    fn builder() -> GgufBuilder {
        let mut b = GgufBuilder::new();
        b.kv("tokenizer.ggml.model", MetadataValue::String("gpt2".into()))
            .kv(
                "tokenizer.ggml.pre",
                MetadataValue::String("llama-bpe".into()),
            )
            .kv(
                "tokenizer.ggml.tokens",
                strings(&["<s>", "a", "b", "c", "ab", "Ġ", "Ġa"]),
            )
            .kv(
                "tokenizer.ggml.token_type",
                MetadataValue::Array(
                    [3, 1, 1, 1, 1, 1, 1]
                        .iter()
                        .map(|&t| MetadataValue::I32(t))
                        .collect(),
                ),
            )
            .kv("tokenizer.ggml.merges", strings(&["a b", "Ġ a"]))
            .kv("tokenizer.ggml.bos_token_id", MetadataValue::U32(0))
            .kv("tokenizer.ggml.add_bos_token", MetadataValue::Bool(true));
        b
    }

    fn open(b: &GgufBuilder) -> (tempfile::TempDir, GgufFile) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        b.write(&path);
        let file = GgufFile::open(&path).unwrap();
        (dir, file)
    }

    #[test]
    fn add_bos_token_prepends_bos_and_control_tokens_are_special() {
        let (_dir, gguf) = open(&builder());
        let files = build_tokenizer(&gguf, 128).unwrap();
        let enc = files.tokenizer.encode("ab a<s>c", true).unwrap();
        assert_eq!(enc.get_ids(), &[0, 4, 6, 0, 3]);
        assert_eq!(files.tokenizer.decode(&[4, 6, 3], false).unwrap(), "ab ac");
        assert_eq!(files.tokenizer_config["bos_token"], "<s>");
        assert_eq!(files.generation_config["bos_token_id"], 0);
    }

    #[test]
    fn unsupported_tokenizers_are_named() {
        let mut b = builder();
        b.kv(
            "tokenizer.ggml.model",
            MetadataValue::String("llama".into()),
        );
        let (_dir, gguf) = open(&b);
        let err = build_tokenizer(&gguf, 128).err().unwrap();
        assert!(
            err.to_string()
                .contains("`llama` is not supported (supported: gpt2)"),
            "{err}"
        );

        let mut b = builder();
        b.kv("tokenizer.ggml.pre", MetadataValue::String("tekken".into()));
        let (_dir, gguf) = open(&b);
        let err = build_tokenizer(&gguf, 128).err().unwrap();
        assert!(
            matches!(err, GgufError::UnsupportedPreTokenizer { .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("smollm"),
            "lists the supported names: {err}"
        );
    }

    #[test]
    fn broken_vocabularies_are_errors() {
        let mut b = builder();
        b.kv("tokenizer.ggml.merges", strings(&["a b", "ab"]));
        let (_dir, gguf) = open(&b);
        let err = build_tokenizer(&gguf, 128).err().unwrap();
        assert!(err.to_string().contains("merge #1"), "{err}");

        let mut b = builder();
        b.kv("tokenizer.ggml.bos_token_id", MetadataValue::U32(99));
        let (_dir, gguf) = open(&b);
        assert!(matches!(
            build_tokenizer(&gguf, 128).err().unwrap(),
            GgufError::InvalidVocabulary { .. }
        ));

        let mut b = builder();
        b.remove_kv("tokenizer.ggml.tokens");
        let (_dir, gguf) = open(&b);
        let err = build_tokenizer(&gguf, 128).err().unwrap();
        assert!(err.to_string().contains("`tokenizer.ggml.tokens`"), "{err}");
    }

    #[test]
    fn several_stop_ids_become_a_list() {
        let ids = SpecialTokenIds {
            eos: Some(2),
            extra_eos: vec![7, 2],
            ..Default::default()
        };
        assert_eq!(ids.eos_json(), json!([2, 7]));
        let ids = SpecialTokenIds {
            eos: Some(2),
            ..Default::default()
        };
        assert_eq!(ids.eos_json(), json!(2));
    }
}
