//! Anthropic's Messages API over the engine (<https://docs.anthropic.com/en/api/messages>):
//! `POST /v1/messages`, plain and streamed, and `POST /v1/messages/count_tokens`. Errors in
//! Anthropic's shape.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use perch_engine::text::tool_calls::{ToolCall, ToolOutput};
use perch_engine::{
    CachePin, ChatMessage, ContentPart, EngineRequest, FinishReason, GenerateRequest,
    GenerationStats, Prompt,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{AnthropicError, ApiError};
use crate::running::{with_header, Running, Step};
use crate::tools::{self, Answer, Forced};
use crate::{AppState, ServedName};

/// The request body of `POST /v1/messages` (and, without the generation fields, of
/// `count_tokens`). Fields Perch does not act on (`metadata`, …) are ignored.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    model: String,
    messages: Vec<Message>,
    system: Option<Content>,
    /// Required by `/v1/messages`.
    max_tokens: Option<usize>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    #[serde(default)]
    stream: bool,
    /// Client tools: `{"name", "description", "input_schema"}`.
    #[serde(default)]
    tools: Vec<Tool>,
    /// `{"type": "auto" | "any" | "tool" | "none"}`; `none` leaves the tools out.
    tool_choice: Option<Value>,
    /// Ollama's `keep_alive` (Perch's extension, as on the OpenAI endpoints).
    keep_alive: Option<crate::openai::KeepAliveField>,
    /// The request's lane (Perch's extension, as on the OpenAI endpoints).
    priority: Option<crate::openai::PriorityField>,
    /// A breakpoint after the last block (Anthropic's automatic prompt caching).
    cache_control: Option<CacheControl>,
}

/// A prompt-caching breakpoint (<https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching>):
/// the prompt up to the end of the block, tool or request that carries it is kept in the prefix
/// cache for `ttl` (`5m`, the default, or `1h`) once computed.
#[derive(Clone, Debug, Deserialize)]
struct CacheControl {
    #[serde(rename = "type")]
    kind: String,
    ttl: Option<String>,
}

impl CacheControl {
    /// Its time to live, or a 400 naming `cache_control` and where it is (`place`).
    fn ttl(&self, place: &str) -> Result<std::time::Duration, ApiError> {
        let invalid = |message: String| {
            ApiError::invalid(format!("{place}: {message}"), Some("cache_control"))
        };
        if self.kind != "ephemeral" {
            return Err(invalid(format!(
                "cache_control.type must be `ephemeral`, not {:?}",
                self.kind
            )));
        }
        match self.ttl.as_deref() {
            None | Some("5m") => Ok(CachePin::DEFAULT_TTL),
            Some("1h") => Ok(CachePin::LONG_TTL),
            Some(other) => Err(invalid(format!(
                "cache_control.ttl must be `5m` or `1h`, not {other:?}"
            ))),
        }
    }
}

/// Where a breakpoint ends the prompt: after tool `k`, system block `k`, block `b` of message
/// `m`, or the whole conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    Tool(usize),
    System(usize),
    Message(usize, usize),
    Whole,
}

/// Breakpoints a request may carry (Anthropic's limit).
const MAX_BREAKPOINTS: usize = 4;

#[derive(Clone, Debug, Deserialize)]
struct Tool {
    name: String,
    description: Option<String>,
    input_schema: Option<Value>,
    #[serde(rename = "type")]
    kind: Option<String>,
    cache_control: Option<CacheControl>,
}

#[derive(Clone, Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// A message's content: a string, or content blocks.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

/// A content block: `text`, `tool_use` (an assistant's call), `tool_result` (the user's
/// answer to one), or `thinking` (an assistant's reasoning, not rendered again).
#[derive(Clone, Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    id: Option<String>,
    name: Option<String>,
    input: Option<Value>,
    tool_use_id: Option<String>,
    content: Option<Content>,
    /// An `image` block's `{"type": "base64", "media_type", "data"}` (or `{"type": "url",
    /// "url"}`, which Perch refuses: it fetches no remote images).
    source: Option<ImageSource>,
    cache_control: Option<CacheControl>,
}

#[derive(Clone, Debug, Deserialize)]
struct ImageSource {
    #[serde(rename = "type")]
    kind: String,
    media_type: Option<String>,
    data: Option<String>,
    url: Option<String>,
}

impl Content {
    fn blocks(&self) -> &[Block] {
        match self {
            Content::Text(_) => &[],
            Content::Blocks(blocks) => blocks,
        }
    }

    /// The text of the content; text blocks are joined by newlines, tool blocks are skipped
    /// (the caller reads them). Other blocks (images, documents) are a 400 naming them.
    fn text(&self, param: &'static str) -> Result<String, ApiError> {
        let blocks = match self {
            Content::Text(text) => return Ok(text.clone()),
            Content::Blocks(blocks) => blocks,
        };
        let mut texts = Vec::new();
        for block in blocks {
            match (block.kind.as_str(), &block.text) {
                ("text", Some(text)) => texts.push(text.as_str()),
                ("tool_use" | "tool_result" | "thinking" | "redacted_thinking", _) => {}
                (kind, _) => {
                    return Err(ApiError::invalid(
                        format!("content blocks of type `{kind}` are not supported; send text"),
                        Some(param),
                    ))
                }
            }
        }
        Ok(texts.join("\n"))
    }
}

impl Content {
    /// The content's text and image blocks in order (text blocks a newline apart, as
    /// [`Content::text`] joins them); tool blocks are skipped; other blocks are a 400.
    fn parts(&self, param: &'static str) -> Result<Vec<ContentPart>, ApiError> {
        let blocks = match self {
            Content::Text(text) => return Ok(vec![ContentPart::Text(text.clone())]),
            Content::Blocks(blocks) => blocks,
        };
        let mut parts = Vec::new();
        for block in blocks {
            match (block.kind.as_str(), &block.text, &block.source) {
                ("text", Some(text), _) => match parts.last_mut() {
                    // Adjacent text blocks are one part, a newline apart (a template may trim
                    // each part).
                    Some(ContentPart::Text(last)) => {
                        last.push('\n');
                        last.push_str(text);
                    }
                    _ => parts.push(ContentPart::Text(text.clone())),
                },
                ("image", _, Some(source)) => {
                    let url = match (source.kind.as_str(), &source.media_type, &source.data) {
                        ("base64", Some(kind), Some(data)) => format!("data:{kind};base64,{data}"),
                        ("url", _, _) => source.url.clone().unwrap_or_default(),
                        _ => {
                            return Err(ApiError::invalid(
                                "an image block's source must be `{\"type\": \"base64\", \"media_type\", \"data\"}`",
                                Some(param),
                            ))
                        }
                    };
                    parts.push(ContentPart::Image(url));
                }
                ("tool_use" | "tool_result" | "thinking" | "redacted_thinking", _, _) => {}
                (kind, _, _) => {
                    return Err(ApiError::invalid(
                        format!(
                        "content blocks of type `{kind}` are not supported; send text or images"
                    ),
                        Some(param),
                    ))
                }
            }
        }
        Ok(parts)
    }
}

impl MessagesRequest {
    /// The conversation as chat-template messages, the system prompt first.
    fn conversation(&self, served: ServedName<'_>) -> Result<Vec<ChatMessage>, ApiError> {
        served.check(&self.model)?;
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages: at least one message is required",
                Some("messages"),
            ));
        }
        self.chat_messages()
    }

    /// The breakpoints (`cache_control` on tools, system blocks, message blocks, then the
    /// request's own), in the prompt's order, each with its time to live; a 400 for a bad one or
    /// more than [`MAX_BREAKPOINTS`].
    fn breakpoints(&self) -> Result<Vec<(Cut, std::time::Duration)>, ApiError> {
        let mut cuts = Vec::new();
        for (k, tool) in self.tools.iter().enumerate() {
            if let Some(control) = &tool.cache_control {
                cuts.push((Cut::Tool(k), control.ttl(&format!("tools.{k}"))?));
            }
        }
        if let Some(system) = &self.system {
            for (k, block) in system.blocks().iter().enumerate() {
                if let Some(control) = &block.cache_control {
                    cuts.push((Cut::System(k), control.ttl(&format!("system.{k}"))?));
                }
            }
        }
        for (m, message) in self.messages.iter().enumerate() {
            for (b, block) in message.content.blocks().iter().enumerate() {
                if let Some(control) = &block.cache_control {
                    cuts.push((
                        Cut::Message(m, b),
                        control.ttl(&format!("messages.{m}.content.{b}"))?,
                    ));
                }
            }
        }
        if let Some(control) = &self.cache_control {
            cuts.push((Cut::Whole, control.ttl("the request")?));
        }
        if cuts.len() > MAX_BREAKPOINTS {
            return Err(ApiError::invalid(
                format!(
                    "at most {MAX_BREAKPOINTS} blocks may carry cache_control; this request has {}",
                    cuts.len()
                ),
                Some("cache_control"),
            ));
        }
        // A breakpoint on the last block of the last message ends the whole prompt.
        let last = self.messages.len().checked_sub(1).map(|m| {
            let blocks = self.messages[m].content.blocks().len();
            Cut::Message(m, blocks.saturating_sub(1))
        });
        for (cut, _) in &mut cuts {
            if Some(*cut) == last {
                *cut = Cut::Whole;
            }
        }
        Ok(cuts)
    }

    /// The request up to the end of `cut`: what the prompt's prefix there is rendered from.
    fn cut(&self, cut: Cut) -> MessagesRequest {
        let mut part = self.clone();
        let keep_blocks = |content: &mut Content, last: usize| {
            if let Content::Blocks(blocks) = content {
                blocks.truncate(last + 1);
            }
        };
        match cut {
            Cut::Tool(k) => {
                part.tools.truncate(k + 1);
                part.system = None;
                part.messages.clear();
            }
            Cut::System(k) => {
                if let Some(system) = &mut part.system {
                    keep_blocks(system, k);
                }
                part.messages.clear();
            }
            Cut::Message(m, b) => {
                part.messages.truncate(m + 1);
                keep_blocks(&mut part.messages[m].content, b);
            }
            Cut::Whole => {}
        }
        part
    }

    /// The chat-template messages, the system prompt first.
    fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        let mut conversation = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            conversation.push(ChatMessage::new("system", system.text("system")?));
        }
        // Tool names by call id, for the tool messages that answer them.
        let mut names = std::collections::HashMap::new();
        for message in &self.messages {
            let text = match message.role.as_str() {
                // A user's images go with its text (below).
                "user" => String::new(),
                _ => message.content.text("messages")?,
            };
            match message.role.as_str() {
                "assistant" => {
                    let calls: Vec<Value> = message
                        .content
                        .blocks()
                        .iter()
                        .filter(|b| b.kind == "tool_use")
                        .map(|b| {
                            let (id, name) = (b.id.clone().unwrap_or_default(), b.name.clone());
                            names.insert(id.clone(), name.clone().unwrap_or_default());
                            json!({"id": id, "type": "function", "function": {
                                "name": name, "arguments": b.input.clone().unwrap_or(json!({})),
                            }})
                        })
                        .collect();
                    let mut assistant = ChatMessage::new("assistant", text);
                    assistant.tool_calls = (!calls.is_empty()).then_some(calls);
                    conversation.push(assistant);
                }
                "user" => {
                    // Tool results first, as the calls they answer came just before; then the
                    // user's own text (a reminder a client appends, say).
                    for block in message.content.blocks() {
                        if block.kind != "tool_result" {
                            continue;
                        }
                        let result = match &block.content {
                            Some(content) => content.text("messages")?,
                            None => String::new(),
                        };
                        let mut tool = ChatMessage::new("tool", result);
                        tool.tool_call_id = block.tool_use_id.clone();
                        tool.name = block
                            .tool_use_id
                            .as_ref()
                            .and_then(|id| names.get(id).cloned());
                        conversation.push(tool);
                    }
                    let only_results = !message.content.blocks().is_empty()
                        && message
                            .content
                            .blocks()
                            .iter()
                            .all(|b| b.kind == "tool_result");
                    if !only_results {
                        let parts = message.content.parts("messages")?;
                        conversation.push(ChatMessage::from_parts("user", parts));
                    }
                }
                role => {
                    return Err(ApiError::invalid(
                        format!("messages: role `{role}` is not one of `user`, `assistant`"),
                        Some("messages"),
                    ))
                }
            }
        }
        Ok(conversation)
    }

    /// The call `tool_choice` forces: `any` (some tool) or `tool` with its `name`; `auto`,
    /// `none` or none given force nothing; another choice is a 400.
    fn forced(&self) -> Result<Option<Forced>, ApiError> {
        let Some(choice) = &self.tool_choice else {
            return Ok(None);
        };
        match (
            choice.get("type").and_then(Value::as_str),
            choice.get("name").and_then(Value::as_str),
        ) {
            (Some("auto" | "none"), _) => Ok(None),
            (Some("any"), _) => Ok(Some(Forced::Any)),
            (Some("tool"), Some(name)) => Ok(Some(Forced::Named(name.to_owned()))),
            _ => Err(ApiError::invalid(
                "`tool_choice.type` must be `auto`, `any`, `tool` (with `name`) or `none`",
                Some("tool_choice"),
            )),
        }
    }

    /// The tools in OpenAI's shape, as chat templates read them; none when `tool_choice` is
    /// `none`. Server tools (Anthropic's own, with a `type`) are a 400.
    fn offered_tools(&self) -> Result<Vec<Value>, ApiError> {
        if self
            .tool_choice
            .as_ref()
            .and_then(|c| c.get("type"))
            .and_then(Value::as_str)
            == Some("none")
        {
            return Ok(Vec::new());
        }
        self.tools
            .iter()
            .map(|tool| {
                let client_tool = tool.kind.as_deref().is_none_or(|k| k == "custom");
                match &tool.input_schema {
                    Some(schema) if client_tool => Ok(json!({"type": "function", "function": {
                        "name": tool.name,
                        "description": tool.description.clone().unwrap_or_default(),
                        "parameters": schema,
                    }})),
                    _ => Err(ApiError::invalid(
                        format!(
                            "tools: `{}` is not a client tool with an input_schema; server tools \
                             are not supported",
                            tool.name
                        ),
                        Some("tools"),
                    )),
                }
            })
            .collect()
    }

    /// The generation settings, or the 400 naming the parameter at fault.
    fn params(&self) -> Result<GenerateRequest, ApiError> {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = match self.max_tokens {
            None => {
                return Err(ApiError::invalid(
                    "max_tokens: field required",
                    Some("max_tokens"),
                ))
            }
            Some(0) => {
                return Err(ApiError::invalid(
                    "max_tokens: must be at least 1",
                    Some("max_tokens"),
                ))
            }
            Some(n) => n,
        };
        let temperature = ApiError::in_range(self.temperature, 1.0, (0.0, 1.0), "temperature")?;
        let top_p = ApiError::in_range(self.top_p, 1.0, (0.0, 1.0), "top_p")?;
        params.sampling.temperature = temperature;
        params.sampling.top_p = top_p;
        params.sampling.top_k = self.top_k.unwrap_or(0);
        params.keep_alive = self
            .keep_alive
            .as_ref()
            .map(crate::openai::KeepAliveField::parse)
            .transpose()?;
        params.priority = crate::openai::PriorityField::lane(&self.priority)?;
        params.stop_strings = self.stop_sequences.clone().unwrap_or_default();
        params.stop_strings.retain(|s| !s.is_empty());
        Ok(params)
    }
}

fn parse(body: Result<Json<MessagesRequest>, JsonRejection>) -> Result<MessagesRequest, ApiError> {
    body.map(|Json(request)| request)
        .map_err(|e| ApiError::invalid(e.body_text(), None))
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model sees them (the chat
/// template applied, with the assistant's turn header).
pub(crate) async fn count_tokens(
    state: AppState,
    body: Result<Json<MessagesRequest>, JsonRejection>,
) -> Result<Json<Value>, AnthropicError> {
    let request = parse(body)?;
    let conversation = request.conversation(state.served_name())?;
    let tools = request.offered_tools()?;
    let (ids, _) = tools::render(state.engine.tokenizer(), conversation, tools).await?;
    Ok(Json(json!({"input_tokens": ids.len()})))
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    state: AppState,
    body: Result<Json<MessagesRequest>, JsonRejection>,
) -> Result<Response, AnthropicError> {
    let request = parse(body)?;
    let conversation = request.conversation(state.served_name())?;
    let mut params = request.params()?;
    let tools = request.offered_tools()?;
    let forced = request.forced()?;
    if let Some(forced) = &forced {
        params.grammar = Some(tools::forced_grammar(&tools, forced)?);
    }
    let tokenizer = Arc::clone(state.engine.tokenizer());
    let breakpoints = request.breakpoints()?;
    let (ids, images) = tools::render(&tokenizer, conversation, tools.clone()).await?;
    params.cache_pins = cache_pins(&request, &breakpoints, &tokenizer, &ids).await;
    params.prompt = ids.clone();
    params.images = images;
    let prompt_tokens = ids.len();
    let running = Running::start(
        &state,
        EngineRequest {
            prompt: Prompt::Tokens(ids),
            params,
        },
    )
    .await?;
    let id = format!("msg_{}", running.id);
    let model = state.model_id.clone();
    let cache_header = running.cache_header();
    let read = running.prompt_cache.as_ref().map_or(0, |r| r.cached_tokens);
    let mut answer = match forced {
        Some(forced) => Answer::forced(forced),
        None => Answer::new(tools::parser(&tokenizer, &tools, true)),
    };
    if request.stream {
        let events = events(running, id, model, (prompt_tokens, read), answer);
        return Ok(with_header(Sse::new(events).into_response(), cache_header));
    }
    let done = running.collect().await?;
    let mut outputs = answer.push(&done.text);
    outputs.extend(answer.finish());
    let mut content: Vec<Value> = Vec::new();
    for output in outputs {
        let block = match output {
            ToolOutput::Text(text) => {
                if let Some(last) = content.last_mut().filter(|b| b["type"] == "text") {
                    last["text"] = format!("{}{text}", last["text"].as_str().unwrap_or("")).into();
                    continue;
                }
                json!({"type": "text", "text": text})
            }
            ToolOutput::Reasoning(text) => {
                json!({"type": "thinking", "thinking": text, "signature": ""})
            }
            ToolOutput::Call(call) => tool_use(&id, answer_index(&content), &call),
        };
        content.push(block);
    }
    if answer.calls > 0 {
        content.retain(|b| b["type"] != "text" || b["text"] != "");
    } else if !content.iter().any(|b| b["type"] == "text") {
        content.push(json!({"type": "text", "text": ""}));
    }
    let (stop_reason, stop_sequence) = match answer.calls {
        0 => stop_reason(done.reason, done.stop_string),
        _ => ("tool_use", None),
    };
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(&done.stats),
    }))
    .into_response())
    .map(|response| with_header(response, cache_header))
}

/// The pins the request's breakpoints ask for: each breakpoint's place in the prompt `ids` is
/// where the prompt and the request cut there ([`MessagesRequest::cut`]), rendered alone,
/// stop agreeing (a chat template closes a cut turn differently, so the prefix they share
/// ends within a token or two of the marked block's end). A cut the template cannot render
/// alone (one that needs a user message) pins nothing; a later breakpoint covers its prefix.
async fn cache_pins(
    request: &MessagesRequest,
    breakpoints: &[(Cut, std::time::Duration)],
    tokenizer: &Arc<perch_engine::Tokenizer>,
    ids: &[u32],
) -> Vec<CachePin> {
    let mut pins = Vec::new();
    for &(cut, ttl) in breakpoints {
        let tokens = match cut {
            Cut::Whole => ids.len(),
            _ => {
                let part = request.cut(cut);
                let (Ok(messages), Ok(tools)) = (part.chat_messages(), part.offered_tools()) else {
                    continue;
                };
                match tools::render(tokenizer, messages, tools).await {
                    Ok((cut_ids, _)) => cut_ids.iter().zip(ids).take_while(|(a, b)| a == b).count(),
                    Err(_) => continue,
                }
            }
        };
        pins.push(CachePin {
            tokens,
            ttl,
            key: None,
        });
    }
    pins
}

/// Anthropic's `stop_reason` and `stop_sequence` for the engine's finish.
fn stop_reason(
    reason: FinishReason,
    stop_string: Option<String>,
) -> (&'static str, Option<String>) {
    match (reason, stop_string) {
        (FinishReason::Length, _) => ("max_tokens", None),
        (_, Some(stop)) => ("stop_sequence", Some(stop)),
        _ => ("end_turn", None),
    }
}

/// Anthropic's `usage`: `cache_read_input_tokens` are the prompt tokens read from the prefix
/// cache, `cache_creation_input_tokens` those this request computed that its breakpoints keep
/// there ([`GenerationStats::cache_creation_tokens`]), `input_tokens` the rest (Anthropic's
/// definitions: the three add up to the prompt).
fn usage(stats: &GenerationStats) -> Value {
    let created = stats.cache_creation_tokens();
    let mut usage = json!({
        "input_tokens": stats.prompt_tokens - stats.cached_prompt_tokens - created,
        "cache_read_input_tokens": stats.cached_prompt_tokens,
        "cache_creation_input_tokens": created,
        "output_tokens": stats.generation_tokens,
    });
    crate::openai::cut_for_memory(&mut usage, stats);
    usage
}

/// Calls in `content` so far: the next call's number.
fn answer_index(content: &[Value]) -> usize {
    content.iter().filter(|b| b["type"] == "tool_use").count()
}

/// A `tool_use` block for call `index` of message `message`.
fn tool_use(message: &str, index: usize, call: &ToolCall) -> Value {
    json!({
        "type": "tool_use",
        "id": format!("toolu_{}_{index}", message.trim_start_matches("msg_")),
        "name": call.name,
        "input": call.arguments,
    })
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// The content blocks of a streamed message: which one is open, and its index.
struct Blocks {
    message: String,
    index: usize,
    open: Option<&'static str>,
    calls: usize,
}

impl Blocks {
    /// Opens a block of `kind` (`text`, `thinking`) unless one is open; closes another kind.
    fn ensure(&mut self, kind: &'static str, out: &mut Vec<Event>) {
        if self.open == Some(kind) {
            return;
        }
        self.close(out);
        let block = match kind {
            "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
            _ => json!({"type": "text", "text": ""}),
        };
        out.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        ));
        self.open = Some(kind);
    }

    fn close(&mut self, out: &mut Vec<Event>) {
        if self.open.take().is_some() {
            out.push(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.index += 1;
        }
    }

    /// The events of parsed output: text and thinking deltas into their blocks, each call a
    /// `tool_use` block of its own with its input in one `input_json_delta`.
    fn events(&mut self, outputs: Vec<ToolOutput>) -> Vec<Event> {
        let mut out = Vec::new();
        for output in outputs {
            match output {
                ToolOutput::Text(text) => {
                    self.ensure("text", &mut out);
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "text_delta", "text": text}}),
                    ));
                }
                ToolOutput::Reasoning(text) => {
                    self.ensure("thinking", &mut out);
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "thinking_delta", "thinking": text}}),
                    ));
                }
                ToolOutput::Call(call) => {
                    self.close(&mut out);
                    let mut block = tool_use(&self.message, self.calls, &call);
                    self.calls += 1;
                    block["input"] = json!({});
                    out.push(event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": self.index,
                               "content_block": block}),
                    ));
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": call.arguments.to_string()}}),
                    ));
                    out.push(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": self.index}),
                    ));
                    self.index += 1;
                }
            }
        }
        out
    }
}

/// The message as Anthropic's event stream: `message_start`, `content_block_start` (a text
/// block), `ping`, `content_block_delta`s, `content_block_stop`, more blocks for reasoning and
/// tool calls as the answer has them, then `message_delta` (stop reason and the final usage) and
/// `message_stop`. An engine failure mid-stream sends an `error` event.
fn events(
    running: Running,
    id: String,
    model: String,
    (prompt_tokens, read): (usize, usize),
    mut answer: Answer,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let mut blocks = Blocks {
        message: id.clone(),
        index: 0,
        open: None,
        calls: 0,
    };
    let mut start = vec![event(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens - read, "cache_read_input_tokens": read,
                      "cache_creation_input_tokens": 0, "output_tokens": 0},
        }}),
    )];
    blocks.ensure("text", &mut start);
    start.push(event("ping", json!({"type": "ping"})));
    let rest = running.into_steps().filter_map(move |step| {
        let out = match step {
            Step::Token { text, .. } => {
                let events = blocks.events(answer.push(&text));
                (!events.is_empty()).then_some(events)
            }
            Step::Done {
                reason,
                stats,
                stop_string,
                ..
            } => {
                let mut out = blocks.events(answer.finish());
                blocks.close(&mut out);
                let (stop_reason, stop_sequence) = match answer.calls {
                    0 => stop_reason(reason, stop_string),
                    _ => ("tool_use", None),
                };
                out.push(event(
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           "usage": usage(&stats)}),
                ));
                out.push(event("message_stop", json!({"type": "message_stop"})));
                Some(out)
            }
            Step::Failed(error) => Some(vec![event("error", AnthropicError(error).body())]),
        };
        std::future::ready(out)
    });
    stream::iter(start)
        .chain(rest.flat_map(stream::iter))
        .map(Ok)
}
