//! Text ↔ token ids: the model's `tokenizer.json` (Hugging Face `tokenizers`), its chat template,
//! its end-of-sequence ids, and a streaming detokenizer.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::image_processor::{ImageInput, ImageProcessor, MAX_IMAGES};
use crate::sample::generation_config::SamplingDefaults;
use crate::sample::grammar::GrammarEnv;
use crate::text::chat_template::{ChatMessage, ChatTemplate, ContentPart};

/// A model's tokenizer and the text conventions that come with it.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// A vision-language model's image processor, or why the model takes no images (see
    /// [`Tokenizer::encode_chat_with_images`]).
    images: Option<std::result::Result<ImageProcessor, String>>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
    sampling_defaults: SamplingDefaults,
    /// The vocabulary as constrained decoding reads it, built on first use.
    grammar_env: std::sync::OnceLock<std::result::Result<std::sync::Arc<GrammarEnv>, String>>,
    /// Every token's bytes ([`crate::sample::grammar::token_bytes`]), read on first use.
    token_bytes: std::sync::OnceLock<std::result::Result<Vec<Vec<u8>>, String>>,
    /// [`Tokenizer::xtc_special_tokens`], encoded once.
    xtc_special_tokens: std::sync::OnceLock<Vec<u32>>,
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (special tokens, chat template),
    /// `chat_template.jinja` when present (it wins over the config's field, as in transformers),
    /// end-of-sequence ids from `generation_config.json`, `config.json` and the tokenizer's
    /// `eos_token`, and the chat sampling defaults of `generation_config.json`
    /// ([`SamplingDefaults`]; a value outside its domain there is an error).
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("tokenizer.json");
        let bytes = crate::limits::read_capped(&path, crate::limits::MAX_TOKENIZER_JSON_BYTES)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| EngineError::Tokenizer(format!("cannot load {}: {e}", path.display())))?;
        drop(bytes);
        let tokenizer_config = read_json_if_exists(&model_dir.join("tokenizer_config.json"))?;
        let special = |key: &str| -> Option<String> {
            let v = tokenizer_config.as_ref()?.get(key)?;
            // Either a plain string or an AddedToken object with `content`.
            v.as_str()
                .or_else(|| v.get("content").and_then(Value::as_str))
                .map(str::to_string)
        };
        let bos_token = special("bos_token");
        let eos_token = special("eos_token");

        let mut eos: BTreeSet<u32> = BTreeSet::new();
        let generation_config_path = model_dir.join("generation_config.json");
        let generation_config = read_json_if_exists(&generation_config_path)?;
        let sampling_defaults = SamplingDefaults::from_generation_config(
            generation_config.as_ref(),
            &generation_config_path,
        )?;
        collect_ids(
            generation_config
                .as_ref()
                .and_then(|c| c.get("eos_token_id")),
            &mut eos,
        );
        if let Some(cfg) = read_json_if_exists(&model_dir.join("config.json"))? {
            collect_ids(cfg.get("eos_token_id"), &mut eos);
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos.insert(id);
        }

        let template_file = model_dir.join("chat_template.jinja");
        let source = if template_file.is_file() {
            Some(crate::limits::read_text_capped(
                &template_file,
                crate::limits::MAX_CONFIG_BYTES,
            )?)
        } else {
            tokenizer_config
                .as_ref()
                .and_then(|c| template_from_config(c.get("chat_template")))
        };
        let chat_template = source
            .map(|s| ChatTemplate::new(s, bos_token, eos_token))
            .transpose()?;
        Ok(Self {
            inner,
            images: None,
            eos_token_ids: eos.into_iter().collect(),
            chat_template,
            sampling_defaults,
            grammar_env: std::sync::OnceLock::new(),
            token_bytes: std::sync::OnceLock::new(),
            xtc_special_tokens: std::sync::OnceLock::new(),
        })
    }

    /// Whether `other` maps the same tokens to the same ids (added tokens included): what a draft
    /// model's tokenizer must do for speculative decoding.
    pub fn same_vocabulary(&self, other: &Tokenizer) -> bool {
        self.inner.get_vocab_size(true) == other.inner.get_vocab_size(true)
            && self.inner.get_vocab(true) == other.inner.get_vocab(true)
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included (a chat's stop tokens are never passed here).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// The text of one token as APIs report it next to its log-probability (OpenAI's
    /// `logprobs[].token`): its bytes ([`Tokenizer::token_bytes`]) as UTF-8, so a word-initial
    /// SentencePiece token keeps its space. A token holding part of a multi-byte character shows
    /// U+FFFD for the missing part; an id outside the vocabulary gives "".
    pub fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.token_bytes(id)).into_owned()
    }

    /// The bytes one token stands for (OpenAI's `logprobs[].bytes`): byte-level BPE tokens
    /// mapped back to bytes, SentencePiece pieces with `▁` as a space and `<0xNN>` as the byte,
    /// special tokens as their text. A tokenizer of another kind gives the token decoded alone;
    /// an id outside the vocabulary gives nothing.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match self.all_token_bytes() {
            Ok(words) => {
                let word = words.get(id as usize).map_or(&[][..], Vec::as_slice);
                word.strip_prefix(&[llguidance::toktrie::TokTrie::SPECIAL_TOKEN_MARKER])
                    .unwrap_or(word)
                    .to_vec()
            }
            Err(_) => self
                .inner
                .decode(&[id], false)
                .unwrap_or_default()
                .into_bytes(),
        }
    }

    fn all_token_bytes(&self) -> std::result::Result<&[Vec<u8>], &str> {
        self.token_bytes
            .get_or_init(|| {
                let json = self.inner.to_string(false).map_err(|e| e.to_string())?;
                crate::sample::grammar::token_bytes(&json)
            })
            .as_deref()
            .map_err(String::as_str)
    }

    /// The vocabulary for constrained decoding ([`crate::sample::grammar`]), built from this
    /// tokenizer on first use (tens of milliseconds) and kept. Errors: a tokenizer whose token
    /// bytes cannot be recovered, as [`EngineError::InvalidGrammar`].
    pub fn grammar_env(&self) -> Result<std::sync::Arc<GrammarEnv>> {
        self.grammar_env
            .get_or_init(|| {
                let words = self.all_token_bytes().map_err(str::to_owned)?;
                GrammarEnv::new(words, &self.eos_token_ids)
                    .map(std::sync::Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| {
                EngineError::InvalidGrammar(format!("this model's tokenizer cannot be used: {e}"))
            })
    }

    /// The ids XTC never excludes, as mlx_lm's `generate` and `server` pass them: the encoding
    /// of "\n" with the tokenizer's special tokens (a BOS, if it adds one) and the
    /// end-of-sequence ids.
    pub fn xtc_special_tokens(&self) -> &[u32] {
        self.xtc_special_tokens.get_or_init(|| {
            let mut ids = self.encode("\n", true).unwrap_or_default();
            ids.extend_from_slice(&self.eos_token_ids);
            ids
        })
    }

    /// Ids that end generation with finish reason `stop`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The sampling a chat with this model uses unless the user sets its own: the model's
    /// `generation_config.json`'s, else Perch's ([`SamplingDefaults`]).
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.sampling_defaults
    }

    /// Renders `messages` with the chat template (with the assistant's generation prompt) and
    /// tokenizes the result without adding special tokens again, as `apply_chat_template` does.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, None)
    }

    /// [`Tokenizer::encode_chat`] with tool definitions for the template's `tools` (see
    /// [`ChatTemplate::render_with_tools`]).
    pub fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
    ) -> Result<Vec<u32>> {
        if messages.iter().any(|m| m.image_urls().next().is_some()) {
            return Err(EngineError::Request(
                "this model takes no images: send the messages without image parts".into(),
            ));
        }
        let text = self.render_chat(messages, tools)?;
        self.encode(&text, false)
    }

    /// The chat template applied to `messages` (with `tools`) and the assistant's turn header:
    /// the prompt's text, image parts written as the template writes them (see
    /// [`crate::image_processor::ImageProcessor::encode_chat`]).
    pub fn render_chat(&self, messages: &[ChatMessage], tools: Option<&[Value]>) -> Result<String> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            EngineError::ChatTemplate(
                "the model has no chat template; pass raw text instead".into(),
            )
        })?;
        template.render_with_tools(messages, tools, true)
    }

    /// Gives the tokenizer the model's image processor (`Ok`), or the reason a vision-language
    /// model takes no images (`Err`: its tower or processor did not load).
    pub fn set_image_processor(&mut self, images: std::result::Result<ImageProcessor, String>) {
        self.images = Some(images);
    }

    /// The model's image processor, when it takes images.
    pub fn image_processor(&self) -> Option<&ImageProcessor> {
        self.images.as_ref().and_then(|i| i.as_ref().ok())
    }

    /// The conversation's prompt tokens and images: the chat template applied (with `tools`)
    /// to messages whose image parts it writes as begin-of-image tokens, each expanded to the
    /// image's run of image tokens ([`ImageProcessor::expand`]), then tokenized; the images read
    /// from their data URLs in order ([`ImageProcessor::process_url`]). Messages without images:
    /// [`Tokenizer::encode_chat_with_tools`]. `Err`: the model takes no images (and why), the
    /// template's, an image's, more than [`MAX_IMAGES`], an image token this tokenizer does not
    /// have.
    pub fn encode_chat_with_images(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
    ) -> Result<(Vec<u32>, Vec<ImageInput>)> {
        let images = self.read_images(messages)?;
        Ok((self.encode_with_images(messages, tools, &images)?, images))
    }

    /// The images of `messages`, in order, as the model's processor prepares them. `Err`: the
    /// model takes no images (and why), more than [`MAX_IMAGES`], an image the processor refuses.
    fn read_images(&self, messages: &[ChatMessage]) -> Result<Vec<ImageInput>> {
        let urls: Vec<&str> = messages.iter().flat_map(ChatMessage::image_urls).collect();
        if urls.is_empty() {
            return Ok(Vec::new());
        }
        let processor = match &self.images {
            Some(Ok(processor)) => processor,
            Some(Err(why)) => {
                return Err(EngineError::Request(format!(
                    "this model's images cannot be read: {why}"
                )))
            }
            None => {
                return Err(EngineError::Request(
                    "this model takes no images: send the messages without image parts".into(),
                ))
            }
        };
        if urls.len() > MAX_IMAGES {
            return Err(EngineError::Request(format!(
                "{} images in one request; the most accepted is {MAX_IMAGES}",
                urls.len()
            )));
        }
        if self.token_id(processor.image_token()).is_none() {
            return Err(EngineError::Request(format!(
                "the tokenizer has no {} token for images",
                processor.image_token()
            )));
        }
        urls.iter().map(|url| processor.process_url(url)).collect()
    }

    /// The prompt tokens of `messages` holding `images` images (read by
    /// [`Tokenizer::read_images`]): each written by the template, then expanded.
    fn encode_with_images(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        images: &[ImageInput],
    ) -> Result<Vec<u32>> {
        let processor = match self.image_processor() {
            Some(processor) if !images.is_empty() => processor,
            _ => return self.encode_chat_with_tools(messages, tools),
        };
        let text = self.render_chat(messages, tools)?;
        self.encode(&processor.expand(&text, images)?, false)
    }

    /// The id of a token written as `text` (a special or added token, or one vocabulary entry).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// [`Tokenizer::encode_chat_with_images`] of as much of the conversation as fits in
    /// `max_prompt_tokens`, as chat apps keep a long conversation going (LM Studio's "truncate
    /// middle", Ollama's context shift): the system messages at the start are always kept, and
    /// whole turns (a user message and everything up to the next one) are dropped oldest first,
    /// with their images; of a conversation holding more than [`MAX_IMAGES`] images, the latest
    /// are kept (the older ones' messages keep their text). Each try renders the template;
    /// about log2(turns) tries; the images are read once.
    ///
    /// Errors: the template's, the images' ([`Tokenizer::encode_chat_with_images`]), and
    /// [`EngineError::PromptTooLong`] (with `max_prompt_tokens` as the context) when the system
    /// messages and the last turn alone do not fit.
    pub fn encode_chat_fitting(
        &self,
        messages: &[ChatMessage],
        max_prompt_tokens: usize,
    ) -> Result<FittedChat> {
        // A conversation holding more images than a request takes keeps its latest ones.
        let total: usize = messages.iter().map(|m| m.image_urls().count()).sum();
        let latest;
        let messages = match total > MAX_IMAGES {
            false => messages,
            true => {
                latest = without_oldest_images(messages, total - MAX_IMAGES);
                &latest[..]
            }
        };
        let images = self.read_images(messages)?;
        // Each message's first image among `images`.
        let mut first_image = Vec::with_capacity(messages.len() + 1);
        let mut seen = 0;
        for message in messages {
            first_image.push(seen);
            seen += message.image_urls().count();
        }
        first_image.push(seen);
        let system = messages.iter().take_while(|m| m.role == "system").count();
        // Where the kept part may start: the first message after the system ones, then each
        // later user message.
        let mut starts = vec![system];
        starts.extend((system + 1..messages.len()).filter(|&i| messages[i].role == "user"));
        // The system messages' images, then those from `start` on.
        let kept_images = |start: usize| {
            images[..first_image[system]]
                .iter()
                .chain(&images[first_image[start]..])
                .cloned()
                .collect::<Vec<_>>()
        };
        let encode_from = |start: usize| {
            let kept: Vec<ChatMessage> = messages[..system]
                .iter()
                .chain(&messages[start..])
                .cloned()
                .collect();
            self.encode_with_images(&kept, None, &kept_images(start))
        };
        let whole = encode_from(system)?;
        if whole.len() <= max_prompt_tokens {
            return Ok(FittedChat {
                tokens: whole,
                images,
                dropped_messages: 0,
            });
        }
        let last = *starts.last().expect("starts holds at least one index");
        let shortest = encode_from(last)?;
        if shortest.len() > max_prompt_tokens {
            return Err(EngineError::PromptTooLong {
                prompt_tokens: shortest.len(),
                context_length: max_prompt_tokens,
            });
        }
        // The earliest start that fits (fewer messages, fewer tokens): binary search over
        // starts[1..], knowing starts[0] does not fit and the last does.
        let (mut lo, mut hi, mut best) = (0, starts.len() - 1, shortest);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let tokens = encode_from(starts[mid])?;
            if tokens.len() <= max_prompt_tokens {
                hi = mid;
                best = tokens;
            } else {
                lo = mid;
            }
        }
        Ok(FittedChat {
            tokens: best,
            images: kept_images(starts[hi]),
            dropped_messages: starts[hi] - system,
        })
    }
}

/// `messages` with their first `drop` images left out (their text kept).
fn without_oldest_images(messages: &[ChatMessage], mut drop: usize) -> Vec<ChatMessage> {
    messages
        .iter()
        .map(|m| {
            let images = m.image_urls().count();
            if drop == 0 || images == 0 {
                return m.clone();
            }
            let mut parts = m.parts.clone();
            parts.retain(|p| match p {
                ContentPart::Image(_) if drop > 0 => {
                    drop -= 1;
                    false
                }
                _ => true,
            });
            ChatMessage {
                tool_calls: m.tool_calls.clone(),
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
                ..ChatMessage::from_parts(m.role.clone(), parts)
            }
        })
        .collect()
}

/// What [`Tokenizer::encode_chat_fitting`] kept of a conversation.
#[derive(Debug)]
pub struct FittedChat {
    pub tokens: Vec<u32>,
    /// The kept messages' images, in the order their tokens hold them.
    pub images: Vec<ImageInput>,
    /// Messages left out (0 when all fit).
    pub dropped_messages: usize,
}

fn read_json_if_exists(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = crate::limits::read_text_capped(path, crate::limits::MAX_CONFIG_BYTES)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| EngineError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
}

fn collect_ids(value: Option<&Value>, into: &mut BTreeSet<u32>) {
    match value {
        Some(Value::Number(n)) => into.extend(n.as_u64().map(|v| v as u32)),
        Some(Value::Array(items)) => {
            into.extend(items.iter().filter_map(Value::as_u64).map(|v| v as u32))
        }
        _ => {}
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which `default` is used.
fn template_from_config(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_string),
        _ => None,
    }
}

/// Turns a growing list of token ids into text deltas without ever emitting half a character.
///
/// Byte-level BPE splits multi-byte characters across tokens; decoding such a prefix yields
/// U+FFFD. Each step decodes the ids since the last emitted boundary (with one token of left
/// context so decoders that strip a leading space do not change the text) and emits only when the
/// text does not end in an incomplete character. [`StreamingDetokenizer::finish`] flushes what
/// is held back; bytes that never completed a character are dropped there.
pub struct StreamingDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl Default for StreamingDetokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamingDetokenizer {
    pub fn new() -> Self {
        Self {
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one token; returns the text it completes (often empty mid-character).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let text = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if text.ends_with('\u{FFFD}')
            || text.len() <= prefix.len()
            || !text.is_char_boundary(prefix.len())
        {
            return Ok(String::new());
        }
        let delta = text[prefix.len()..].to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Text still held back at the end of generation, without a trailing incomplete character.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let text = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        let rest = text.get(prefix.len()..).unwrap_or("");
        Ok(rest.trim_end_matches('\u{FFFD}').to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Llama 2 style SentencePiece tokenizer (BPE with `▁` for spaces and a byte fallback),
    /// small enough to write here.
    const SENTENCEPIECE: &str = r#"{
      "version": "1.0",
      "added_tokens": [
        {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
      ],
      "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
      ]},
      "pre_tokenizer": null,
      "post_processor": null,
      "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}
      ]},
      "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "▁Hello": 4, "▁world": 5, "!": 6},
                "merges": []}
    }"#;

    #[test]
    fn sentencepiece_token_text_keeps_the_word_initial_space() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), SENTENCEPIECE).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "</s>"}"#,
        )
        .unwrap();
        let tokenizer = Tokenizer::load(dir.path()).unwrap();
        // Decoded alone, the first piece of a text loses its space (the decoder strips it).
        assert_eq!(tokenizer.inner.decode(&[5], false).unwrap(), "world");
        assert_eq!(tokenizer.token_text(4), " Hello");
        assert_eq!(tokenizer.token_text(5), " world");
        assert_eq!(tokenizer.token_text(6), "!");
        assert_eq!(tokenizer.token_bytes(3), b"\n");
        assert_eq!(tokenizer.token_text(2), "</s>");
        assert_eq!(tokenizer.token_text(99), "");
        // The pieces of a text spell it, spaces included (its first space is the one the
        // normalizer prepends).
        let spelled: String = [4, 5, 6]
            .iter()
            .map(|&id| tokenizer.token_text(id))
            .collect();
        assert_eq!(spelled, " Hello world!");
        assert_eq!(
            tokenizer.inner.decode(&[4, 5, 6], false).unwrap(),
            "Hello world!"
        );
    }
}
